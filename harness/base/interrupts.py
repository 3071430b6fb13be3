"""Sections that an interrupting signal must not cut in two.

A run's SIGINT/SIGTERM handler (runs/lifecycle.py) raises an exception wherever the main thread is. Between the
engine recording that round r is done and its hooks receiving round r's rows, that would leave a run that says
r rounds while its results end at r - 1. Inside `atomic()`, the handler's exception waits until the section ends,
and is raised there.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_depth = 0
_pending: list[BaseException] = []


@contextlib.contextmanager
def atomic() -> Iterator[None]:
    """Run the body whole: an interrupt() that arrives inside is raised when it ends (where the body raises an
    exception of its own, that one goes on up and ends the run instead)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():  # signal handlers run in the main thread only
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        waiting = _pending[:] if _depth == 0 else []
        if _depth == 0:
            _pending.clear()  # never left for a later section (a sweep's next run in this process)
    if waiting:
        raise waiting[0]


def interrupt(err: BaseException) -> None:
    """Raise `err` now, or at the end of the atomic section the main thread is in (for a signal handler)."""
    if _depth:
        _pending.append(err)
        return
    raise err
