"""`fedharness tune --compare a,b,c`: tune each algorithm alike, then re-run each best config on fresh seeds.

Every algorithm gets its own study `<study>-<algorithm>` with the same space, objective,
budget, sampler seed and number of trials. Each best configuration is then run once more
with `tune.compare.replicas` independent replicas at seed `tune.compare.seed` (the data stay
those of the tuning seed: `dataset.data_seed` is pinned), and the objective of each replica
gives a mean and a standard deviation (ddof=1) per algorithm:

    <results_dir>/compare/study=<study>/compare.parquet   and   <results_dir>/tune/<study>/compare.md
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa

from fedharness.config.compose import group_options
from fedharness.config.load import load_settings
from fedharness.errors import ConfigError, require
from fedharness.base.progress import echo
from fedharness.results import layout
from fedharness.results.store import ResultsStore
from fedharness.results.tables import write_table
from fedharness.runs.execute import execute
from fedharness.runs.lifecycle import open_results
from fedharness.studies.tuning.export import best_trial, shown
from fedharness.studies.tuning.optuna_parts import open_study
from fedharness.studies.tuning.spec import TuneSpec, build_spec, compose_tune, split_tune, trial_config
from fedharness.studies.tuning.storage import check_reachable
from fedharness.studies.tuning.study import tune

COMPARE_SCHEMA = pa.schema([
    ("algorithm", pa.string()), ("tune_study", pa.string()), ("n_trials", pa.int64()),
    ("objective", pa.string()), ("direction", pa.string()), ("budget_kind", pa.string()),
    ("budget_total", pa.int64()), ("best_trial", pa.int64()), ("tuned_value", pa.float64()),
    ("params_json", pa.string()), ("rounds", pa.int64()), ("seed", pa.int64()), ("replicas", pa.int64()),
    ("mean", pa.float64()), ("std", pa.float64()), ("values_json", pa.string()), ("status", pa.string()),
    ("run_id", pa.string()), ("overrides", pa.string()),
])


def _algorithms(text: str) -> list[str]:
    algs = [a.strip() for a in text.split(",") if a.strip()]
    require(len(algs) >= 1, "--compare", text, "a comma-separated list of algorithms, e.g. fedavg,fednova")
    require(len(set(algs)) == len(algs), "--compare", text, "each algorithm once")
    for a in algs:
        if a not in group_options("algorithm"):
            raise ConfigError("--compare", a, group_options("algorithm"))
    return algs


def _compare_settings(spec: TuneSpec) -> tuple[int, int]:
    return spec.compare["replicas"], spec.compare["seed"]  # checked with the other tune.* keys


def rerun_overrides(spec: TuneSpec, params: dict) -> list[str]:
    """The best config at fresh seeds, with the tuning data pinned."""
    replicas, seed = _compare_settings(spec)
    _, overrides = trial_config(spec, params)
    extra = [f"seed={seed}", f"replicas={replicas}"]
    if spec.base_data_seed is None:
        extra.append(f"dataset.data_seed={spec.base_seed}")
    return [*overrides, *extra]


def _rerun(spec: TuneSpec, study_name: str, algorithm: str, store: ResultsStore) -> dict:
    study = open_study(spec)
    best = best_trial(spec, study.get_trials(deepcopy=False))
    row = {"study": study_name, "algorithm": algorithm, "tune_study": spec.study, "n_trials": spec.n_trials,
           "objective": spec.objective.name, "direction": spec.objective.direction,
           "budget_kind": spec.budget.kind, "budget_total": spec.budget.total}
    if best is None:
        return {**row, "status": "no finite trial"}
    overrides = rerun_overrides(spec, best.params)
    settings = load_settings(overrides).replace(results_dir=spec.results_dir, progress=False, study=study_name)
    result = execute(settings, store=store)
    values = spec.objective.per_replica(result.rows, result.status)
    std = float(np.std(values, ddof=1)) if len(values) > 1 and np.all(np.isfinite(values)) else None
    return {**row, "best_trial": best.number, "tuned_value": best.value, "params_json": json.dumps(best.params),
            "rounds": settings.rounds, "seed": settings.seed, "replicas": settings.replicas,
            "mean": float(np.mean(values)), "std": std, "values_json": json.dumps([float(v) for v in values]),
            "status": result.status, "run_id": result.run_id, "overrides": " ".join(overrides)}


def markdown(rows: list[dict]) -> str:
    def num(v) -> str:
        return "" if v is None else (f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v))

    head = rows[0]
    lines = [f"Study `{head['study']}`: {head['objective']} ({head['direction']}), budget {head['budget_total']} "
             f"{head['budget_kind']} per run, {head['n_trials']} trials per algorithm.", "",
             "| algorithm | best trial | tuned value | best parameters | rounds | replicas | mean | std |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        params = ", ".join(f"{k}={num(v)}" for k, v in json.loads(r.get("params_json") or "{}").items())
        lines.append(f"| {r['algorithm']} | {num(r.get('best_trial'))} | {num(r.get('tuned_value'))} | {params} | "
                     f"{num(r.get('rounds'))} | {num(r.get('replicas'))} | {num(r.get('mean'))} | "
                     f"{num(r.get('std'))} |")
    return "\n".join(lines) + "\n"


def run_compare(overrides: list[str], algorithms_text: str) -> int:
    algs = _algorithms(algorithms_text)
    tune_name, tune_ovs, run_ovs = split_tune(overrides)
    for ov in run_ovs:
        require(ov.lstrip("+~").partition("=")[0] != "algorithm", "algorithm", ov.partition("=")[2],
                "set by --compare; leave algorithm= out")
    base = compose_tune(tune_name, tune_ovs).get("study") or tune_name
    specs = [build_spec(overrides, (f"algorithm={a}",), study=f"{base}-{a}") for a in algs]  # all checked first
    for spec in specs:
        check_reachable(spec)
    store = open_results(specs[0].results_dir)  # the studies share it: one results_dir
    for spec in specs:
        echo(tune(spec, store, echo=echo)["text"])
    rows = [_rerun(spec, base, a, store) for spec, a in zip(specs, algs)]
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in COMPARE_SCHEMA} for r in rows],
                                 schema=COMPARE_SCHEMA)
    table_key, md_key = layout.compare_key(base), layout.study_key(base, "compare.md")
    write_table(store, table_key, table)
    text = markdown(rows)
    store.write(md_key, text.encode())
    print(text + f"\ncompare: {shown(f'{store.url}/{table_key}')} and {shown(f'{store.url}/{md_key}')}")
    return 0
