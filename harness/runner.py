"""One run from a validated config: build everything (validating), then train and record to Parquet."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import uuid
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedharness.closed_forms import heterogeneity
from fedharness.core.checkpoint import Checkpointer, checkpointed, load_resume
from fedharness.core.engine import Engine, NetworkModel, RunOutcome
from fedharness.core.executors import InlineExecutor, ReferenceExecutor
from fedharness.core.kernels import resolve_kernel
from fedharness.core.series import build_series
from fedharness.lifecycle import RunInterrupted, interrupts_raised, process_start
from fedharness.parts import build_parts
from fedharness.core.runtime import apply_runtime
from fedharness.reference_policy import run_client_minima, run_reference
from fedharness.sinks.masking import mask_secrets
from fedharness.sinks.parquet import ParquetSink
from fedharness.sinks.wandb_sink import open_sink as open_wandb

VERSIONED = ("fedharness", "torch", "numpy", "pyarrow", "ray", "optuna", "wandb", "hydra-core")


@dataclass
class RunResult:
    run_id: str
    status: str
    rows: list[dict]
    results_dir: Path


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> str:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return json.dumps(found, sort_keys=True)


def new_run_id() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def build_executor(cfg: dict[str, Any], problem, solver):
    if cfg["executor"] == "reference":
        return ReferenceExecutor(problem, solver)
    if cfg["executor"] == "ray":
        from fedharness.backends.ray_executor import RayExecutor

        return RayExecutor(cfg, problem, solver)
    return InlineExecutor(problem, solver, cfg["num_shards"])


def prepare(cfg: dict[str, Any]):
    """Build problem, algorithm and exact reference: every check that can fail happens here, before any file."""
    problem, algorithm = build_parts(cfg)
    resolve_kernel(cfg, problem, checkpointed(cfg, "kernel") if cfg.get("resume") else None)
    build_series(cfg["algorithm"], cfg["replicas"])  # validates rr / burn_in / average
    return problem, algorithm, run_reference(cfg, problem)  # per `reference: auto | on | off`


def _exact_references(cfg: dict[str, Any], problem, reference) -> dict:
    """F* and Li et al.'s heterogeneity Gamma = F* - sum p_k F_k* for the run row (null where not known)."""
    if reference is None:
        return {"f_star": None, "gamma_heterogeneity": None}
    minima = run_client_minima(cfg, problem, reference)
    return {"f_star": reference.f_star,
            "gamma_heterogeneity": None if minima is None else heterogeneity(problem, reference.f_star, minima)}


def _run_row(cfg: dict[str, Any], status: str, rounds_done: int, started: str, error: str | None = None) -> dict:
    return {
        "study": cfg["study"], "experiment": cfg["experiment"], "algorithm": cfg["algorithm"]["name"],
        "dataset": cfg["dataset"]["name"], "partition": cfg["partition"]["name"], "model": cfg["model"]["name"],
        "seed": cfg["seed"], "n_replicas": cfg["replicas"], "status": status, "rounds_done": rounds_done,
        "config_json": json.dumps(mask_secrets(cfg), sort_keys=True, default=str), "git_sha": _git_sha(),
        "started_at": started, "finished_at": None if status == "running" else _now(),
        "versions_json": _versions(), "host": platform.node(), "error": mask_secrets(error), "trial": cfg.get("trial"),
        "pid": os.getpid(), "pid_start": process_start(os.getpid()),
    }


def _end_status(err: BaseException) -> str:
    """The status of a run an exception ended: interrupted (a signal), pruned (an Optuna prune raised from
    on_eval; optuna is only looked up if the tuner already imported it), else failed."""
    if isinstance(err, RunInterrupted):
        return "interrupted"
    optuna = sys.modules.get("optuna")
    return "pruned" if optuna is not None and isinstance(err, optuna.TrialPruned) else "failed"


def set_threads(cfg: dict[str, Any]) -> None:
    """The process's torch settings: `precision` and `deterministic` (harness/core/runtime.py), and intra-op
    threads: `threads` if set; else 1 for a single replica of a linear model or quadratic,
    whose small operations gain nothing from more threads (and lose badly on a busy machine), and torch's
    default otherwise (64 replicas of W1 run 1.5x faster on 2 idle cores than on 1)."""
    apply_runtime(cfg)  # first: cuBLAS reads its workspace setting (deterministic) at its first matmul
    threads = cfg.get("threads")
    small = cfg["model"]["name"] in ("auto", "logreg", "linreg", "quadratic") and cfg["replicas"] == 1
    if threads is None and small:
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)


def execute(cfg: dict[str, Any], progress=None, run_id: str | None = None, on_eval=None) -> RunResult:
    """Run one config end to end. Raises ConfigError before writing anything if the config is bad.

    `progress(round, rows)` and `on_eval(rows, state)` are called after every evaluation;
    an exception from `on_eval` ends the run with status failed (pruned for optuna.TrialPruned).
    SIGINT/SIGTERM (in the main thread) raise RunInterrupted, telling where the run stood; status interrupted.
    Either way the rounds so far are flushed and `rounds_done` is the last completed round.
    """
    set_threads(cfg)
    problem, algorithm, reference = prepare(cfg)
    layout, series = build_series(cfg["algorithm"], cfg["replicas"])
    exact = _exact_references(cfg, problem, reference)
    network = NetworkModel.from_config(cfg.get("network"))  # sim_s per round; validated before any file
    resumed = load_resume(cfg) if cfg.get("resume") else None  # checked before any cluster or file
    executor = build_executor(cfg, problem, algorithm.solver)
    run_id = resumed.run_id if resumed else (run_id or new_run_id())
    sink = ParquetSink(cfg["results_dir"], run_id)
    started = resumed.started if resumed else _now()
    wb = open_wandb(cfg, run_id)  # None unless wandb.enabled; offline without an API key
    if resumed:
        sink.drop_after(resumed.round)  # rows past the checkpoint are recomputed: each round lands once

    def on_rows(rows, state):
        sink.add_rounds(rows)
        if wb is not None:
            wb.log_rows(rows)
        if on_eval is not None:
            on_eval(rows, state)

    ckpt = Checkpointer(cfg, run_id, started, sink, executor) if cfg.get("checkpoint_every") else None
    if ckpt is not None and resumed is not None and resumed.state is not None:
        ckpt.round = resumed.round
    engine = Engine(problem, algorithm, executor, rounds=cfg["rounds"], seed=cfg["seed"],
                    replicas=cfg["replicas"], eval_every=cfg["eval_every"], reference=reference,
                    on_rows=on_rows, progress=progress, layout=layout, series=series, network=network,
                    checkpoint=ckpt.save if ckpt else None, checkpoint_every=cfg.get("checkpoint_every", 0))
    # From the `running` row on, a signal records the run as interrupted; also while recording the end,
    # so a second signal cannot cut it short.
    with interrupts_raised():
        try:
            sink.write_run({**_run_row(cfg, "running", 0, started), **exact})
            if resumed is not None and resumed.state is not None:
                executor.set_state(resumed.client_state)
            outcome: RunOutcome = engine.run(resumed.state if resumed else None)
        except BaseException as err:
            _record_end(cfg, sink, wb, exact, started, engine.rounds_done, err)
            if isinstance(err, RunInterrupted):
                err.run_id, err.rounds_done = run_id, engine.rounds_done
                err.checkpoint_round = None if ckpt is None else ckpt.round if ckpt.round is not None else 0
            raise
        finally:
            executor.close()
    sink.flush()
    sink.write_run({**_run_row(cfg, outcome.status, outcome.rounds_done, started), **exact})
    if wb is not None:
        wb.finish(outcome.status, cfg["results_dir"], outcome.rows)
    return RunResult(run_id, outcome.status, outcome.rows, Path(cfg["results_dir"]))


def _record_end(cfg: dict[str, Any], sink: ParquetSink, wb, exact: dict, started: str, rounds_done: int,
                err: BaseException) -> None:
    """The rows so far, and the run row of a run that an exception (or a signal) ended."""
    status = _end_status(err)
    sink.flush()
    error = f"interrupted by {err}" if status == "interrupted" else f"{type(err).__name__}: {err}"
    sink.write_run({**_run_row(cfg, status, rounds_done, started, error), **exact})
    if wb is not None:
        wb.finish(status, cfg["results_dir"])


def summary_table(rows: list[dict]) -> str:
    """A short text table of the last evaluated round: mean and std over replicas."""
    last = max(r["round"] for r in rows)
    final = [r for r in rows if r["round"] == last and r["series"] == "iterate"]
    lines = [f"{'metric':<14}{'mean':>14}{'std':>12}   (round {last}, {len(final)} replica(s))"]
    for name in ("train_loss", "subopt", "dist_to_opt", "grad_norm_sq", "test_loss", "test_acc", "wall_s"):
        vals = np.array([r[name] for r in final if r.get(name) is not None], dtype=float)
        if len(vals):
            lines.append(f"{name:<14}{vals.mean():>14.6g}{vals.std():>12.3g}")
    return "\n".join(lines)
