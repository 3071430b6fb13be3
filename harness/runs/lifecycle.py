"""The run record: a run's runs/ row (the one function that builds one), how it starts and ends, and how it ends
when it cannot finish: interrupted by a signal, or killed outright (found later as `lost`).

A run records through hooks of its run (harness/contracts.py Callback), in this order: its Parquet rows, its runs/
row (`running` when it starts, its status when it ends), its W&B run, the caller's own hooks, a user's callbacks
and its checkpoints (`RunRecord.hooks`).

SIGINT and SIGTERM during a run raise `RunInterrupted` in the main thread, so the run records
`status=interrupted` with its rounds (see `fedharness.runs.execute.execute`). A run killed with SIGKILL cannot write
anything: its `runs/` row stays `running`. The next command that opens the same results directory
(`fedharness run`, `tune`, `sweep`, `report`) marks such a row `lost` when the process that wrote it is
gone: same host, and no process with that pid and start time is alive. Rows of other hosts are left alone.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from fedharness.algorithms.privacy import final_epsilon
from fedharness.base.interrupts import interrupt
from fedharness.contracts import Callback, RoundContext, callback_name
from fedharness.core.checkpoint import Checkpointer, Resume, restore_rows
from fedharness.core.engine import RunOutcome
from fedharness.errors import ConfigError
from fedharness.results import layout
from fedharness.results.store import ResultsStore, check_writable, open_store
from fedharness.results.tables import read_table
from fedharness.settings import RunSettings
from fedharness.sinks.masking import mask_secrets
from fedharness.sinks.parquet import RUN_SCHEMA, ParquetSink
from fedharness.sinks.wandb_sink import open_sink as open_wandb

log = logging.getLogger(__name__)

INTERRUPTING = (signal.SIGINT, signal.SIGTERM)
VERSIONED = ("fedharness", "torch", "numpy", "pyarrow", "ray", "optuna", "wandb", "hydra-core")


class RunInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived during a run. `execute` fills in where the run stood."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.run_id: str | None = None
        self.rounds_done = 0
        self.checkpoint_round: int | None = None  # the last checkpointed round; None: the run keeps none

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process the signal ended: 130, 143


@contextlib.contextmanager
def interrupts_raised() -> Iterator[None]:
    """While inside, SIGINT/SIGTERM raise RunInterrupted once; repeats are ignored so the recording that
    follows is not cut short. Nested inside another (a run inside a sweep or a study) it does nothing, so the
    repeats stay ignored until the outermost one has recorded its part too. Only the main thread can own
    signal handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread() or \
            getattr(signal.getsignal(signal.SIGTERM), "raises_run_interrupted", False):
        yield
        return
    raised = []

    def handler(signum, frame):
        if not raised:
            raised.append(signum)
            interrupt(RunInterrupted(signum))  # at once, or where the engine's atomic section ends

    handler.raises_run_interrupted = True
    old = {s: signal.signal(s, handler) for s in INTERRUPTING}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None without /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces; fields from 3 on follow it
    return None if fields[0] == "Z" else int(fields[19])  # a zombie has ended


def process_alive(pid: int, started: int | None) -> bool:
    """Whether the process that wrote a row is still running here (a reused pid has another start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return started is None or process_start(pid) == started  # no start time recorded (no /proc): trust the pid


def last_recorded_round(store: ResultsStore, run_id: str) -> int:
    """The last round in the run's rounds/ parts (their names hold the round range); 0 when none."""
    return max((layout.part_rounds(name)[1] for name in layout.round_parts(store, run_id)), default=0)


def open_results(results_dir: str | Path) -> ResultsStore:
    """The results store a command (run, sweep, tune) records into, opened once and handed down: an object store
    that is missing or refuses us is one line before any run starts, and the runs a killed process left `running`
    are marked lost first."""
    store = open_store(results_dir)
    check_writable(store)
    mark_lost_runs(store)
    return store


def mark_lost_runs(store: ResultsStore) -> list[str]:
    """Mark `running` rows of this host whose process is gone as `lost`, with the rounds they recorded."""
    host, marked = platform.node(), []
    for key in store.list(layout.RUNS):
        run_id = layout.run_of(key)
        if run_id is None or key != layout.run_key(run_id):
            continue
        try:
            table = read_table(store, key)
        except (OSError, ValueError):
            continue  # unreadable rows are the report's business, not this sweep's
        row = table.to_pylist()[0] if table is not None and table.num_rows == 1 else {}
        if row.get("status") != "running" or row.get("host") != host or row.get("pid") is None:
            continue
        if process_alive(row["pid"], row.get("pid_start")):
            continue
        try:
            restore_rows(ParquetSink(store, run_id), run_id)  # killed between its checkpoint and that checkpoint's rows
        except (ConfigError, OSError) as err:
            log.warning(f"run {run_id}: its checkpoint is unreadable ({err}); rows after its last part are lost")
        rounds = last_recorded_round(store, run_id)
        row = {k: v for k, v in row.items() if k in RUN_SCHEMA.names}
        row.update(status="lost", rounds_done=rounds, error=f"process {row['pid']} on {host} ended without "
                   f"recording how (killed?); found by a later command; rounds_done = the last recorded round")
        try:
            ParquetSink(store, run_id).write_run(row)
        except OSError as err:
            log.warning(f"could not mark run {run_id} lost: {err}")
            continue
        log.warning(f"run {run_id} was left running by process {row['pid']}, which is gone: "
                    f"marked lost (rounds_done={rounds})")
        marked.append(run_id)
    return marked


def now() -> str:
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


def split_invariant(settings: RunSettings) -> bool:
    """Whether the run's rows are the same bits for any split of its clients into shards, inline or on Ray
    (docs/cluster.md): client contributions meet in exact sums everywhere, and on the CPU each client's own
    computation does not depend on which clients share its batch (tests/test_same_bits.py). On CUDA that is not
    verified (cuDNN and cuBLAS may pick kernels by batch shape), so a CUDA run does not claim it; nor does a run
    with `sums: float` (float64 sums, whose bits depend on the split)."""
    return torch.device(settings.device).type == "cpu" and settings.sums == "exact"


@cache  # by pid, so a forked child reads its own: /proc/<pid>/stat takes milliseconds in a process of many threads
def _own_start(pid: int) -> int | None:
    return process_start(pid)


def config_json(settings: RunSettings) -> str:
    """The runs/ row's config_json: the run's config, secrets masked, as sorted JSON."""
    return json.dumps(mask_secrets(settings.config), sort_keys=True, default=str)


def run_row(settings: RunSettings, status: str, rounds_done: int, started: str, error: str | None = None,
            callbacks: Sequence[str] = (), exact: dict | None = None, batch_id: str | None = None,
            config: str | None = None) -> dict:
    """The run's runs/ row. `exact`: F* and the heterogeneity Gamma (null where not known); `batch_id`: the
    batched run it trained in as one slot (null: alone); `config`: its config_json (settings') if already made."""
    return {
        "study": settings.study, "experiment": settings.experiment, "algorithm": settings.algorithm.name,
        "dataset": settings.dataset.name, "partition": settings.partition.name, "model": settings.model.name,
        "seed": settings.seed, "n_replicas": settings.replicas, "status": status, "rounds_done": rounds_done,
        "config_json": config_json(settings) if config is None else config, "git_sha": _git_sha(),
        "started_at": started, "finished_at": None if status == "running" else now(),
        "versions_json": _versions(), "host": platform.node(), "error": mask_secrets(error), "trial": settings.trial,
        "pid": os.getpid(), "pid_start": _own_start(os.getpid()),
        "callbacks": json.dumps(list(callbacks)), "metrics": json.dumps(list(settings.metrics)),
        "split_invariant": split_invariant(settings), **(exact or {}), "batch_id": batch_id,
        "epsilon": final_epsilon(settings.dp, settings.dataset.num_clients, settings.algorithm.clients_per_round,
                                 rounds_done),
    }


def end_status(err: BaseException) -> str:
    """The status of a run an exception ended: interrupted (a signal), pruned (an Optuna prune raised from a hook;
    optuna is only looked up if the tuner already imported it), else failed."""
    if isinstance(err, RunInterrupted):
        return "interrupted"
    optuna = sys.modules.get("optuna")
    return "pruned" if optuna is not None and isinstance(err, optuna.TrialPruned) else "failed"


def error_text(outcome: RunOutcome) -> str | None:
    """How the runs/ row and the RunResult name what ended the run early (None: nothing did)."""
    if outcome.status == "stopped":
        return "stopped by a callback"
    if outcome.error is None:
        return None
    if outcome.status == "interrupted":
        return f"interrupted by {outcome.error}"
    return f"{type(outcome.error).__name__}: {outcome.error}"


class EvalFunction(Callback):
    """`on_eval(rows, state)` after every evaluation, the start (round 0) included; an exception from it ends the
    run (status pruned for optuna.TrialPruned, else failed)."""

    def __init__(self, on_eval: Callable[[list[dict], Any], None]):
        self.on_eval = on_eval

    def on_evaluation(self, context: RoundContext) -> None:
        self.on_eval(context.rows, context.state)


class UserCallbacks(Callback):
    """A user's callbacks (fedharness.run(..., callbacks=[...])): after every round, and after every evaluated
    round but the start; all are called, and one returning True stops the run."""

    def __init__(self, callbacks: Sequence[Any]):
        self.callbacks = list(callbacks)

    def on_round_end(self, context: RoundContext) -> bool:
        return any([bool(cb.on_round_end(context)) for cb in self.callbacks])

    def on_evaluation(self, context: RoundContext) -> bool:
        return context.round > 0 and any([bool(cb.on_evaluation(context)) for cb in self.callbacks])

    def on_end(self, outcome: RunOutcome) -> None:
        for cb in self.callbacks:
            if callable(getattr(cb, "on_end", None)):  # a callback that does not subclass Callback may lack it
                cb.on_end(outcome)


def record_failed_run(settings: RunSettings, run_id: str, error: str, store: ResultsStore) -> None:
    """A runs/ row with status=failed and the rounds the run recorded, for a run whose process ended before it
    wrote its final row (a sweep task that failed outside the run); a final row the run wrote is left alone."""
    table = read_table(store, layout.run_key(run_id), columns=["status"])
    if table is not None and table.column("status")[0].as_py() != "running":
        return
    ParquetSink(store, run_id).write_run(run_row(settings, "failed", last_recorded_round(store, run_id), now(),
                                                 error))


class RunRecord(Callback):
    """One run's record in a results store: its rows (ParquetSink), its runs/ row, its W&B run (when enabled) and
    its checkpoints (checkpoint_every > 0), all told by the run's engine through `hooks`. `resumed`: the
    checkpoint a resumed run continues from (its rows past it are dropped: each round lands once)."""

    def __init__(self, settings: RunSettings, run_id: str, store: ResultsStore, executor, *, exact: dict,
                 hooks: Sequence[Callback] = (), callbacks: Sequence[Any] = (), batch_id: str | None = None,
                 resumed: Resume | None = None, client_names: list[str] | None = None):
        self.settings, self.run_id, self.exact, self.batch_id = settings, run_id, exact, batch_id
        self.sink = ParquetSink(store, run_id, extra_columns=settings.metrics,
                                clients_table=settings.eval.clients_table, client_names=client_names)
        self.started = resumed.started if resumed else now()
        self.callback_names = [callback_name(cb) for cb in callbacks]
        self.config_json = config_json(settings)  # the same in the running row and the final one: made once
        self.outcome: RunOutcome | None = None
        if resumed:
            restore_rows(self.sink, run_id)  # the checkpoint's rows, if the process died before writing them
            self.sink.drop_after(resumed.round)  # rows past the checkpoint are recomputed
        self.checkpointer = None
        if settings.checkpoint_every:
            self.checkpointer = Checkpointer(settings, run_id, self.started, self.sink, executor)
        wandb = open_wandb(settings, run_id, store)  # None unless wandb.enabled; offline without an API key
        self.hooks = [h for h in (self.sink, self, wandb, *hooks, UserCallbacks(callbacks) if callbacks else None,
                                  self.checkpointer) if h is not None]

    def write(self, status: str, rounds_done: int, error: str | None = None) -> None:
        self.sink.write_run(run_row(self.settings, status, rounds_done, self.started, error, self.callback_names,
                                    self.exact, self.batch_id, self.config_json))

    def start(self) -> None:
        self.write("running", 0)

    def on_end(self, outcome: RunOutcome) -> None:
        """After the sink wrote the rows: the run row with how the run ended."""
        self.outcome = outcome
        self.write(outcome.status, outcome.rounds_done, error_text(outcome))

    @property
    def checkpoint_round(self) -> int | None:
        """The checkpointed round a resume continues from (0: none yet); None: the run keeps no checkpoints."""
        return None if self.checkpointer is None else self.checkpointer.saved_round()
