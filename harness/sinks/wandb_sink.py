"""Weights & Biases sink: the run's config, one history step per evaluated round (the replicas' mean and std), a
summary, the Parquet files as an artifact; and, for `fedharness report --wandb`, the report's figures and tables.

Mode `auto` runs online when an API key is configured (WANDB_API_KEY or a netrc entry) and offline otherwise;
a WANDB_MODE set in the environment wins. Offline runs land under WANDB_DIR (default ./wandb) and the harness
prints the `wandb sync` command that uploads them later. A run never waits on the network: an online start that
fails within `init_timeout_s` falls back to offline.

History layout: one W&B history step per evaluated round, holding `round` (the step metric) and, for every
numeric column of that round's Parquet rows (metrics, counters, a user's metric columns), the mean over the
replicas under the column's name and their standard deviation (numpy's, ddof=0) under `<name>_std`: `train_loss`,
`train_loss_std`. The `iterate` series keeps the bare names; the other series are prefixed with theirs:
`average/train_loss`, `rr/train_loss_std`. Nulls are left out of both (a metric null in every replica is not
logged). The per-replica values stay in Parquet; `wandb.per_replica=true` logs them too, as their own series
`train_loss/replica_3`, `average/train_loss/replica_3`. With `eval.per_client=true` the step also holds the
distribution over clients as W&B histograms, `client_acc_hist` and `client_loss_hist` (every replica's clients
with held-out data), besides the client_* columns' means and stds.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fedharness.base.extras import require_extra
from fedharness.contracts import Callback, ClientScores, RoundContext
from fedharness.settings import RunSettings, WandbSettings
from fedharness.sinks.masking import mask_secrets
from fedharness.results import layout
from fedharness.results.store import ResultsStore

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 30.0


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        return bool(read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")))
    except Exception:  # no netrc, or a wandb whose internals moved: treat as no key
        return False


def resolve_mode(mode: str) -> str:
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in ("offline", "dryrun"):
        return "offline"
    if env == "disabled":
        return "disabled"
    if env == "online" or mode == "online":
        return "online"
    if mode == "offline":
        return "offline"
    return "online" if has_api_key() else "offline"


def _init(mode: str, **kwargs):
    """wandb.init that never blocks on the network for long: online failures fall back to offline.

    W&B would record the command line (which may hold `tune.storage` with its password), the git state and the
    code; it gets none of them, and every string it is given has its URL passwords masked.
    """
    wandb = require_extra("wandb", "wandb.enabled", True)

    settings = wandb.Settings(init_timeout=INIT_TIMEOUT_S, console="off", silent=True, x_disable_meta=True,
                              disable_git=True, disable_code=True, save_code=False)
    kwargs = mask_secrets(kwargs)
    try:
        return wandb.init(mode=mode, settings=settings, reinit="finish_previous", **kwargs), mode
    except Exception as err:
        if mode != "online":
            raise
        log.warning(f"wandb: could not start online ({type(err).__name__}: {str(err)[:200]}); logging offline")
        return wandb.init(mode="offline", settings=settings, reinit="finish_previous", **kwargs), "offline"


def _say_sync(run, mode: str) -> None:
    if mode == "offline":
        where = Path(run.dir).parent
        log.info(f"wandb: offline run saved in {where}; upload it later with: wandb sync {where}")


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, np.generic) else v


ROW_KEYS = ("round", "replica", "series")  # what tells a round's rows apart: not averaged


def _number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def round_step(rows: list[dict], per_replica: bool = False) -> dict[str, Any]:
    """One round's Parquet rows (every replica and series) as one history step: per series and numeric column,
    the mean and std over the replicas that have a value, and with `per_replica` each replica's value."""
    step: dict[str, Any] = {"round": int(rows[0]["round"])}
    for series in dict.fromkeys(r["series"] for r in rows):
        prefix = "" if series == "iterate" else f"{series}/"
        mine = [r for r in rows if r["series"] == series]
        for name in dict.fromkeys(k for r in mine for k in r if k not in ROW_KEYS):
            values = [(r["replica"], r[name]) for r in mine if _number(r.get(name))]
            if not values:
                continue  # null in every replica, or not a number
            arr = np.array([v for _, v in values], dtype=np.float64)
            step[f"{prefix}{name}"] = float(arr.mean())
            step[f"{prefix}{name}_std"] = float(arr.std())
            if per_replica:
                step.update({f"{prefix}{name}/replica_{int(rep)}": _plain(v) for rep, v in values})
    return step


def client_histograms(scores: ClientScores) -> dict[str, Any]:
    """The evaluation's per-client accuracies and losses (all replicas, clients with held-out data) as histograms."""
    import wandb

    has = scores.n > 0
    return {"client_acc_hist": wandb.Histogram(scores.acc[:, has].reshape(-1)),
            "client_loss_hist": wandb.Histogram(scores.loss[:, has].reshape(-1))}


# Time-to-accuracy in W&B: these columns' replica means are logged again under by_sim_s/, whose x axis is sim_s
# (every other metric's is the round).
BY_SIM_S = "by_sim_s"
SIM_S_CURVES = ("train_loss", "subopt", "test_loss", "test_acc")


class WandbSink(Callback):
    """One W&B run per harness run: a hook of the run that logs each evaluation's rows and, when the run ends, its
    summary and its Parquet objects in `store` (the run's results store)."""

    def __init__(self, settings: RunSettings, run_id: str, store: ResultsStore):
        w = settings.wandb
        self.run_id, self.store = run_id, store
        self.mode = resolve_mode(w.mode)
        self.run, self.mode = _init(
            self.mode, project=w.project, entity=w.entity, group=w.group or settings.study, tags=list(w.tags),
            name=run_id, job_type="run", config={**settings.config, "run_id": run_id})
        self.run.define_metric("round")
        self.run.define_metric("sim_s")  # simulated seconds (the systems clock, docs/systems.md): the other x axis
        self.run.define_metric(f"{BY_SIM_S}/*", step_metric="sim_s")
        self.run.define_metric("*", step_metric="round")
        self.per_replica = w.per_replica
        self.metrics = settings.metrics  # the user's own metric columns, summarised like the built-in ones

    def log_rows(self, rows: list[dict], clients: ClientScores | None = None) -> None:
        """One history step per evaluated round among the rows (the engine hands over one round at a time), with
        the round's per-client distribution when there is one."""
        for rnd in sorted({r["round"] for r in rows}):
            step = round_step([r for r in rows if r["round"] == rnd], self.per_replica)
            step.update({f"{BY_SIM_S}/{name}": step[name] for name in SIM_S_CURVES if name in step})
            if clients is not None:
                step.update(client_histograms(clients))
            self.run.log(step)

    def on_evaluation(self, context: RoundContext) -> None:
        self.log_rows(context.rows, context.clients)

    def on_end(self, outcome) -> None:
        self.finish(outcome.status, outcome.rows)

    def finish(self, status: str, rows: list[dict]) -> None:
        """The summary, and the run's Parquet objects in its results store as an artifact."""
        import wandb

        summary: dict[str, Any] = {"status": status, "run_id": self.run_id}
        final = [r for r in rows or [] if r.get("series") == "iterate"]
        if final:
            last = max(r["round"] for r in final)
            summary["rounds_done"] = last
            for name in ("train_loss", "subopt", "dist_to_opt", "grad_norm_sq", "test_loss", "test_acc",
                         "bytes_up", "bytes_down", "sim_s", *self.metrics):
                vals = [r[name] for r in final if r["round"] == last and r.get(name) is not None]
                if vals:
                    summary[f"final/{name}_mean"] = float(np.mean(vals))
                    summary[f"final/{name}_std"] = float(np.std(vals))
        self.run.summary.update(summary)
        artifact = wandb.Artifact(f"results-{self.run_id}", type="parquet",
                                  description="this run's rows of the results contract (runs/ and rounds/)")
        with tempfile.TemporaryDirectory() as staging:  # the store may be remote; add_file copies (policy mutable)
            for key in [*self.store.list(layout.run_folder(layout.ROUNDS, self.run_id)), layout.run_key(self.run_id),
                        *self.store.list(layout.run_folder(layout.CLIENTS, self.run_id))]:
                data = self.store.read(key)
                if data is not None:
                    path = Path(staging, key)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
                    artifact.add_file(str(path), name=key)
            self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if status in ("ok", "diverged") else 1)
        _say_sync(self.run, self.mode)


def open_sink(settings: RunSettings, run_id: str, store: ResultsStore) -> WandbSink | None:
    """A sink when `wandb.enabled` is true, else None."""
    return WandbSink(settings, run_id, store) if settings.wandb.enabled else None


def log_report(report, w: WandbSettings) -> None:
    """A `job_type=report` run holding the report's figures (images) and tables (W&B tables), and report.md."""
    wandb = require_extra("wandb", "--wandb", True)

    mode = resolve_mode(w.mode)
    group = w.group or ",".join(sorted(report.tables["runs"]["study"].dropna().unique()))
    run, mode = _init(mode, project=w.project, entity=w.entity, group=group,
                      tags=list(w.tags), job_type="report", name=f"report-{group}",
                      config={"targets": [t.label for t in report.targets], "scale_key": report.design.scale_key,
                              "group_keys": report.design.group_keys})
    run.log({f"figures/{name}": wandb.Image(str(path)) for name, path in report.figures.items()})
    for name, df in report.tables.items():
        if name.startswith("replicas_"):
            continue  # per-replica detail stays in the CSV files of the artifact
        run.log({f"tables/{name}": wandb.Table(dataframe=df.astype(object).where(df.notna(), None))})
    artifact = wandb.Artifact(re.sub(r"[^A-Za-z0-9._-]", "_", f"report-{group}")[:120], type="report")
    artifact.add_dir(str(report.out_dir))
    run.log_artifact(artifact)
    run.finish()
    _say_sync(run, mode)
