"""How a run ends when it cannot finish: interrupted by a signal, or killed outright (found later as `lost`).

SIGINT and SIGTERM during a run raise `RunInterrupted` in the main thread, so the run records
`status=interrupted` with its rounds (see `fedharness.runs.execute.execute`). A run killed with SIGKILL cannot write
anything: its `runs/` row stays `running`. The next command that opens the same results directory
(`fedharness run`, `tune`, `sweep`, `report`) marks such a row `lost` when the process that wrote it is
gone: same host, and no process with that pid and start time is alive. Rows of other hosts are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import threading
from pathlib import Path
from typing import Iterator

from fedharness.core.checkpoint import restore_rows
from fedharness.errors import ConfigError
from fedharness.sinks.parquet import RUN_SCHEMA, ParquetSink, part_rounds, read_table, round_parts
from fedharness.results.store import ResultsStore

log = logging.getLogger(__name__)

INTERRUPTING = (signal.SIGINT, signal.SIGTERM)


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
            raise RunInterrupted(signum)

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
    return max((part_rounds(name)[1] for name in round_parts(store, run_id)), default=0)


def mark_lost_runs(store: ResultsStore) -> list[str]:
    """Mark `running` rows of this host whose process is gone as `lost`, with the rounds they recorded."""
    host, marked = platform.node(), []
    for key in store.list("runs"):
        folder, _, name = key.rpartition("/")
        if name != "run.parquet" or not folder.startswith("runs/run_id=") or folder.count("/") != 1:
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
        run_id = folder.removeprefix("runs/run_id=")
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
