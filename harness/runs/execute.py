"""One run from its settings (harness/settings.py): build everything (validating), then train and record to
Parquet."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import uuid
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from fedharness.references.closed_forms import heterogeneity
from fedharness.contracts import Callback, callback_name
from fedharness.registry.groups import METRICS
from fedharness.core.checkpoint import Checkpointer, checkpointed, load_resume, restore_rows
from fedharness.core.engine import Engine, NetworkModel, RunOutcome
from fedharness.core.executors import InlineExecutor, LoopExecutor
from fedharness.core.kernels import resolve_kernel
from fedharness.algorithms.series import build_series
from fedharness.base.extras import require_extra
from fedharness.runs.lifecycle import RunInterrupted, interrupts_raised, process_start
from fedharness.assembly.build import build_parts
from fedharness.base.runtime import apply_runtime, auto_threads, step_work, use_threads
from fedharness.assembly.reference_policy import run_client_minima, run_reference
from fedharness.settings import RunSettings
from fedharness.sinks.masking import mask_secrets
from fedharness.sinks.parquet import ParquetSink
from fedharness.sinks.wandb_sink import open_sink as open_wandb
from fedharness.results.store import ResultsStore, open_store

VERSIONED = ("fedharness", "torch", "numpy", "pyarrow", "ray", "optuna", "wandb", "hydra-core")


@dataclass
class RunResult:
    run_id: str
    status: str
    rows: list[dict]
    results_dir: str  # the results store's url: an absolute path or an object-store URL
    error: str | None = None  # what ended a failed run (harness/runs/batch.py sets it; execute raises instead)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@cache  # once a process: its code is the checkout it imported, and `git` is a subprocess for each row otherwise
def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@cache  # the packages a process imported do not change under it; metadata lookups scan every installed one
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


def build_executor(settings: RunSettings, problem, solver):
    if settings.executor == "loop":
        return LoopExecutor(problem, solver)
    if settings.executor == "ray":
        require_extra("ray", "executor", "ray")  # without the extra: one line naming fedharness[ray]
        from fedharness.backends.ray_executor import RayExecutor

        return RayExecutor(settings, problem, solver)
    return InlineExecutor(problem, solver, settings.num_shards)


@dataclass
class Prepared:
    """A run built and checked, before any file: its settings as the run records them (the kernel resolved), the
    problem, the algorithm, the exact reference (or None), and the replica layout and series hooks."""

    settings: RunSettings
    problem: Any
    algorithm: Any
    reference: Any
    layout: Any
    series: list


def prepare_run(settings: RunSettings, store: ResultsStore | None = None) -> Prepared:
    """Build problem, algorithm and exact reference: every check that can fail happens here, before any file.
    `store`: where a resumed run's checkpoint is (default: settings.results_dir's store)."""
    problem, algorithm = build_parts(settings)
    set_threads(settings, problem)  # threads=null follows the problem's size: before kernel timing and reference
    resumed_kernel = checkpointed(settings, "kernel", store) if settings.resume else None
    settings = settings.replace(kernel=resolve_kernel(settings, problem, resumed_kernel))
    layout, series = build_series(settings.replicas, **settings.algorithm.params)  # rr=H needs a fixed H
    reference = run_reference(settings, problem)  # per `reference: auto | on | off`
    return Prepared(settings, problem, algorithm, reference, layout, series)


def prepare(settings: RunSettings):
    """`prepare_run`'s problem, algorithm and exact reference."""
    run = prepare_run(settings)
    return run.problem, run.algorithm, run.reference


def _exact_references(settings: RunSettings, problem, reference) -> dict:
    """F* and Li et al.'s heterogeneity Gamma = F* - sum p_k F_k* for the run row (null where not known)."""
    if reference is None:
        return {"f_star": None, "gamma_heterogeneity": None}
    minima = run_client_minima(settings, problem, reference)
    return {"f_star": reference.f_star,
            "gamma_heterogeneity": None if minima is None else heterogeneity(problem, reference.f_star, minima)}


def _run_row(settings: RunSettings, status: str, rounds_done: int, started: str, error: str | None = None,
             callbacks: Sequence[str] = ()) -> dict:
    return {
        "study": settings.study, "experiment": settings.experiment, "algorithm": settings.algorithm.name,
        "dataset": settings.dataset.name, "partition": settings.partition.name, "model": settings.model.name,
        "seed": settings.seed, "n_replicas": settings.replicas, "status": status, "rounds_done": rounds_done,
        "config_json": json.dumps(mask_secrets(settings.config), sort_keys=True, default=str), "git_sha": _git_sha(),
        "started_at": started, "finished_at": None if status == "running" else _now(),
        "versions_json": _versions(), "host": platform.node(), "error": mask_secrets(error), "trial": settings.trial,
        "pid": os.getpid(), "pid_start": process_start(os.getpid()),
        "callbacks": json.dumps(list(callbacks)), "metrics": json.dumps(list(settings.metrics)),
        "split_invariant": split_invariant(settings),
    }


def split_invariant(settings: RunSettings) -> bool:
    """Whether the run's rows are the same bits for any split of its clients into shards, inline or on Ray
    (docs/cluster.md): client contributions meet in exact sums everywhere, and on the CPU each client's own
    computation does not depend on which clients share its batch (tests/test_same_bits.py). On CUDA that is not
    verified (cuDNN and cuBLAS may pick kernels by batch shape), so a CUDA run does not claim it."""
    return torch.device(settings.device).type == "cpu"


def _end_status(err: BaseException) -> str:
    """The status of a run an exception ended: interrupted (a signal), pruned (an Optuna prune raised from
    on_eval; optuna is only looked up if the tuner already imported it), else failed."""
    if isinstance(err, RunInterrupted):
        return "interrupted"
    optuna = sys.modules.get("optuna")
    return "pruned" if optuna is not None and isinstance(err, optuna.TrialPruned) else "failed"


def set_threads(settings: RunSettings, problem=None) -> None:
    """The process's torch settings: `precision` and `deterministic` (harness/base/runtime.py), and intra-op
    threads: `threads` if set; else, once the problem is built, threads_for(settings, problem)."""
    if problem is None:
        apply_runtime(settings.precision, settings.deterministic)  # cuBLAS reads `deterministic` at its 1st matmul
    threads = settings.threads if settings.threads is not None or problem is None else threads_for(settings, problem)
    if threads is not None:
        use_threads(threads)


def threads_for(settings: RunSettings, problem) -> int:
    """`threads: null`: from the work of one local step (dim x clients per round x batch x replicas), not the
    model's name, so a user's tiny net gets 1 thread like a built-in linear model and a big one gets more."""
    algo = settings.algorithm
    clients = problem.num_clients if algo.sampler == "full" else min(problem.num_clients, algo.clients_per_round)
    return auto_threads(step_work(problem.dim, clients, settings.algorithm.batch_size, settings.replicas))


def execute(settings: RunSettings, progress=None, run_id: str | None = None, on_eval=None,
            callbacks: Sequence[Callback] = (), store: ResultsStore | None = None) -> RunResult:
    """Run one config (its settings: fedharness.config.load.load_settings) end to end. Raises ConfigError before
    writing anything if the config is bad.

    `progress(round, rows)` and `on_eval(rows, state)` are called after every evaluation;
    an exception from `on_eval` ends the run with status failed (pruned for optuna.TrialPruned).
    `callbacks` (harness/contracts.py Callback) see every round and evaluation; one returning True ends the run
    with status stopped. The metrics the `metrics` key names are computed at every evaluation.
    SIGINT/SIGTERM (in the main thread) raise RunInterrupted, telling where the run stood; status interrupted.
    Either way the rounds so far are flushed and `rounds_done` is the last completed round.
    `store` (harness/results/store.py) receives every object the run writes (rows, run row, checkpoints) and holds the
    checkpoint a resumed run continues from; default: the store `settings.results_dir` names.
    """
    set_threads(settings)
    store = open_store(settings.results_dir) if store is None else store
    run = prepare_run(settings, store)
    settings, problem, algorithm, reference = run.settings, run.problem, run.algorithm, run.reference
    exact = _exact_references(settings, problem, reference)
    network = NetworkModel.of(settings.network)  # sim_s per round
    resumed = load_resume(settings, store) if settings.resume else None  # checked before any cluster or file
    executor = build_executor(settings, problem, algorithm.solver)
    run_id = resumed.run_id if resumed else (run_id or new_run_id())
    sink = ParquetSink(store, run_id, extra_columns=settings.metrics)
    started = resumed.started if resumed else _now()
    names = [callback_name(cb) for cb in callbacks]
    wb = open_wandb(settings, run_id)  # None unless wandb.enabled; offline without an API key
    if resumed:
        restore_rows(sink, run_id)  # the checkpoint's rows, if the process died before writing them
        sink.drop_after(resumed.round)  # rows past the checkpoint are recomputed: each round lands once

    def on_rows(rows, state):
        sink.add_rounds(rows)
        if wb is not None:
            wb.log_rows(rows)
        if on_eval is not None:
            on_eval(rows, state)

    ckpt = Checkpointer(settings, run_id, started, sink, executor) if settings.checkpoint_every else None
    if ckpt is not None and resumed is not None and resumed.state is not None:
        ckpt.round = resumed.round
    engine = Engine(problem, algorithm, executor, rounds=settings.rounds, seed=settings.seed,
                    replicas=settings.replicas, eval_every=settings.eval_every, reference=reference,
                    on_rows=on_rows, progress=progress, layout=run.layout, series=run.series, network=network,
                    checkpoint=ckpt.save if ckpt else None, checkpoint_every=settings.checkpoint_every,
                    metrics=[METRICS[name] for name in settings.metrics], callbacks=callbacks)
    # From the `running` row on, a signal records the run as interrupted; also while recording the end,
    # so a second signal cannot cut it short.
    with interrupts_raised():
        try:
            sink.write_run({**_run_row(settings, "running", 0, started, callbacks=names), **exact})
            if resumed is not None and resumed.state is not None:
                executor.set_state(resumed.client_state)
            outcome: RunOutcome = engine.run(resumed.state if resumed else None)
        except BaseException as err:
            _record_end(settings, sink, wb, exact, started, engine.rounds_done, err, names)
            if isinstance(err, RunInterrupted):
                err.run_id, err.rounds_done = run_id, engine.rounds_done
                err.checkpoint_round = None if ckpt is None else ckpt.round if ckpt.round is not None else 0
            raise
        finally:
            executor.close()
    sink.flush()
    stopped = "stopped by a callback" if outcome.status == "stopped" else None
    sink.write_run({**_run_row(settings, outcome.status, outcome.rounds_done, started, stopped, names), **exact})
    if wb is not None:
        wb.finish(outcome.status, store, outcome.rows)
    return RunResult(run_id, outcome.status, outcome.rows, store.url)


def _record_end(settings: RunSettings, sink: ParquetSink, wb, exact: dict, started: str, rounds_done: int,
                err: BaseException, callbacks: Sequence[str]) -> None:
    """The rows so far, and the run row of a run that an exception (or a signal) ended."""
    status = _end_status(err)
    sink.flush()
    error = f"interrupted by {err}" if status == "interrupted" else f"{type(err).__name__}: {err}"
    sink.write_run({**_run_row(settings, status, rounds_done, started, error, callbacks), **exact})
    if wb is not None:
        wb.finish(status, sink.store)


def summary_table(rows: list[dict]) -> str:
    """A short text table of the last evaluated round: mean and std over replicas."""
    last = max(r["round"] for r in rows)
    final = [r for r in rows if r["round"] == last and r["series"] == "iterate"]
    lines = [f"{'metric':<14}{'mean':>14}{'std':>12}   (round {last}, {len(final)} replica(s))"]
    for name in ("train_loss", "train_loss_se", "subopt", "dist_to_opt", "grad_norm_sq", "test_loss", "test_acc",
                 "wall_s"):  # train_loss_se: only where train_loss is an estimate
        vals = np.array([r[name] for r in final if r.get(name) is not None], dtype=float)
        if len(vals):
            lines.append(f"{name:<14}{vals.mean():>14.6g}{vals.std():>12.3g}")
    return "\n".join(lines)
