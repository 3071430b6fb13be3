"""What a study leaves behind: `trials/` Parquet, the best overrides, and plots (PNG), all through the results
store (harness/results/store.py: a folder or an object store).

* `<results_dir>/trials/study=<study>/trials.parquet`: one row per trial (surplus claims,
  which never ran, are left out; the study is the hive partition): number, state, status, objective value, parameters
  (`params_json` and one `param_<name>` column each), rounds, budget used, run_id.
* `<results_dir>/tune/<study>/best.overrides`: one Hydra override per line; `fedharness run
  $(cat best.overrides)` re-runs the best trial's config and gives its objective exactly.
* `<results_dir>/tune/<study>/history.png` and `importance.png` (drawn without pyplot).
"""

from __future__ import annotations

import io
import json
import math
import os
import warnings
from pathlib import Path

import pyarrow as pa

from fedharness.results import layout
from fedharness.results.store import ResultsStore
from fedharness.studies.tuning.privacy import study_epsilon
from fedharness.results.tables import write_table
from fedharness.sinks.masking import mask_secrets
from fedharness.sinks.parquet import column

TRIAL_COLUMNS = [  # `study` is the hive partition (trials/study=<name>/), as run_id is for runs/
    ("trial", pa.int64()), ("state", pa.string()), ("status", pa.string()),
    ("value", pa.float64()), ("objective", pa.string()), ("direction", pa.string()), ("params_json", pa.string()),
    ("budget_kind", pa.string()), ("budget_total", pa.int64()), ("budget_used", pa.int64()),
    ("rounds", pa.int64()), ("run_id", pa.string()), ("started_at", pa.string()), ("finished_at", pa.string()),
    ("duration_s", pa.float64()), ("worker", pa.string()), ("error", pa.string()),
]


def trial_status(t) -> str:
    """ok / diverged / pruned / failed from the trial itself; lost = failed by a dead worker's missed heartbeats."""
    status = t.user_attrs.get("status")
    if status is not None:
        return status
    return {"FAIL": "lost", "RUNNING": "running", "WAITING": "waiting", "PRUNED": "pruned"}.get(t.state.name, "ok")


def trial_rows(spec, trials) -> list[dict]:
    rows = []
    for t in sorted(trials, key=lambda t: t.number):
        if t.user_attrs.get("status") == "surplus":
            continue
        row = {
            "trial": t.number, "state": t.state.name, "status": trial_status(t),
            "value": t.value if t.state.name == "COMPLETE" else None, "objective": spec.objective.name,
            "direction": spec.objective.direction, "params_json": json.dumps(t.params, sort_keys=True),
            "budget_kind": spec.budget.kind, "budget_total": spec.budget.total,
            "budget_used": t.user_attrs.get("budget_used"), "rounds": t.user_attrs.get("rounds"),
            "run_id": t.user_attrs.get("run_id"), "error": t.user_attrs.get("error"),
            "worker": t.user_attrs.get("worker"),
            "started_at": t.datetime_start.isoformat() if t.datetime_start else None,
            "finished_at": t.datetime_complete.isoformat() if t.datetime_complete else None,
            "duration_s": t.duration.total_seconds() if t.duration else None,
        }
        for p in spec.params:
            row[f"param_{p.name}"] = t.params.get(p.name)
        rows.append(mask_secrets(row))
    return rows


def trials_table(spec, trials) -> pa.Table:
    rows = trial_rows(spec, trials)
    fields = [pa.field(n, t) for n, t in TRIAL_COLUMNS]
    for p in spec.params:
        kind = {"float": pa.float64(), "int": pa.int64()}.get(p.type)
        if kind is None:  # categorical: one type if the choices share one, else their text
            types = {type(c) for c in p.choices if c is not None}
            kind = {frozenset({float}): pa.float64(), frozenset({int}): pa.int64(), frozenset({bool}): pa.bool_(),
                    frozenset({int, float}): pa.float64()}.get(frozenset(types), pa.string())
            if kind == pa.string():
                for r in rows:
                    r[f"param_{p.name}"] = None if r[f"param_{p.name}"] is None else str(r[f"param_{p.name}"])
        fields.append(pa.field(f"param_{p.name}", kind))
    schema = pa.schema(fields)
    # sinks.parquet.column, not pa.Table.from_pylist: that imports pandas, a quarter of a CPU second of the study
    return pa.Table.from_arrays([column([r.get(f.name) for r in rows], f.type) for f in schema], schema=schema)


def best_trial(spec, trials):
    """The best COMPLETE trial with a finite value (None if there is none)."""
    done = [t for t in trials if t.state.name == "COMPLETE" and t.value is not None and math.isfinite(t.value)]
    if not done:
        return None
    if spec.objective.direction == "minimize":
        return min(done, key=lambda t: (t.value, t.number))
    return max(done, key=lambda t: (t.value, -t.number))  # ties: the earliest trial


def shown(path: str | Path) -> str:
    """A path as the user would type it: relative to the working directory when it is below it; a URL as it is."""
    if "://" in str(path):
        return str(path)
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def _save_figure(fig, store: ResultsStore, key: str) -> str:
    """The figure as PNG under `key`; returns where it is."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    store.write(key, buf.getvalue())
    return f"{store.url}/{key}"


def _history_figure(study, name: str, trials: list):
    """Each finite trial's value by trial number, and the best so far (Optuna's optimization history)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    numbers, values = [t.number for t in trials], [t.value for t in trials]
    better = min if study.direction.name == "MINIMIZE" else max
    best = [better(values[:i + 1]) for i in range(len(values))]
    ax.plot(numbers, values, "o", label=name)
    ax.plot(numbers, best, "-", color="tab:red", label="best value")
    if min(values) > 0 and max(values) > 100 * min(values):  # e.g. distances spanning many decades
        ax.set_yscale("log")
    ax.set_title("optimization history")
    ax.set_xlabel("trial")
    ax.set_ylabel(name)
    ax.legend()
    return fig


def _importance_figure(study, name: str):
    """Hyperparameter importances for the objective (Optuna's default evaluator, fANOVA), as horizontal bars."""
    import optuna
    from matplotlib.figure import Figure

    importances = optuna.importance.get_param_importances(study)  # ValueError etc. when it cannot be computed
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    params = list(importances)[::-1]
    ax.barh(params, [importances[p] for p in params], color="tab:blue")
    ax.set_title(f"hyperparameter importances for {name}")
    ax.set_xlabel("importance")
    return fig


def plot_study(spec, study, store: ResultsStore) -> dict[str, str]:
    """Optimization history and parameter importances as PNG; a plot that cannot be drawn is named with why.
    Drawn on matplotlib Figure objects, not pyplot: the process's backend (a notebook's) stays as it is."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # "trial N is omitted (inf)": diverged trials, known

    out: dict[str, str] = {}
    finite_trials = [t for t in study.get_trials(deepcopy=False)
                     if t.state.name == "COMPLETE" and t.value is not None and math.isfinite(t.value)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if finite_trials:  # diverged trials (+-inf) are left off
            out["history"] = _save_figure(_history_figure(study, spec.objective.name, finite_trials), store,
                                          layout.study_key(spec.study, "history.png"))
        else:
            out["history"] = "not drawn: no trial with a finite value"
        try:
            out["importance"] = _save_figure(_importance_figure(study, spec.objective.name), store,
                                             layout.study_key(spec.study, "importance.png"))
        except (ValueError, RuntimeError, ZeroDivisionError) as err:
            out["importance"] = f"not drawn: {err}"
    return out


def export_study(spec, study, store: ResultsStore) -> dict:
    """Write trials/, best.overrides and plots into `store`; return paths and a text summary."""
    trials = study.get_trials(deepcopy=False)
    table = trials_table(spec, trials)
    trials_key = layout.trials_key(spec.study)
    write_table(store, trials_key, table)
    trials_path = f"{store.url}/{trials_key}"
    rows = table.to_pylist()
    count = {s: sum(r["status"] == s for r in rows) for s in ("ok", "diverged", "pruned", "failed", "lost")}
    lines = [f"study {spec.study}: {count['ok'] + count['diverged']} complete ({count['diverged']} diverged), "
             f"{count['pruned']} pruned, {count['failed'] + count['lost']} failed; "
             f"budget {spec.budget.total} {spec.budget.kind} per trial",
             f"  trials:  {shown(trials_path)}"]
    summary = {"trials": str(trials_path), "best": None}
    spent = study_epsilon(store, [r["run_id"] for r in rows if r["run_id"]])
    if spent is not None:  # tuning on private data costs privacy: every trial's (docs/privacy.md)
        eps, dp_trials, mechanism = spent
        summary["epsilon"] = eps
        lines.append(f"  privacy: the {dp_trials} DP trials together spent epsilon = {eps:.4g} at delta = "
                     f"{mechanism['delta']:g} ({mechanism['accountant']}; each trial's own epsilon is in runs/)")
    best = best_trial(spec, trials)
    if best is not None:
        best_key = layout.study_key(spec.study, "best.overrides")
        store.write(best_key, ("\n".join(mask_secrets(best.user_attrs["overrides"])) + "\n").encode())
        best_path = f"{store.url}/{best_key}"
        params = ", ".join(f"{k}={v!r}" for k, v in best.params.items())
        lines[1:1] = [f"best: trial {best.number}: {spec.objective.name} = {best.value:.6g} ({params}; "
                      f"{best.user_attrs.get('rounds')} rounds)"]
        rerun = "" if "://" in best_path else f"   (fedharness run $(cat {shown(best_path)}))"  # not for a URL
        lines.append(f"  best:    {shown(best_path)}{rerun}")
        summary.update(best=str(best_path), best_trial=best.number, best_value=best.value, best_params=best.params)
    else:
        lines.append("  best:    none (no complete trial with a finite value)")
    if spec.plots:
        plots = plot_study(spec, study, store)
        summary["plots"] = plots
        lines.append("  plots:   " + "; ".join(v if v.startswith("not drawn") else shown(v) for v in plots.values()))
    summary["text"] = "\n".join(lines)
    summary["table"] = table
    return summary
