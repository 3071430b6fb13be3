"""Progress on long work: a bar over the rounds of a run, on stderr; the command line's progress lines.

Where the stream is live (a terminal, or a Jupyter notebook, where tqdm.auto draws a widget) progress is a
tqdm.auto bar. Anywhere else (a CI log, a Ray worker's log, a file) it is plain lines, at most one every
LOG_EVERY_S seconds and a last one at the end: a redrawn bar would write a carriage-return frame per update.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from fedharness.contracts import Callback, RoundContext

LOG_EVERY_S = 5.0  # a non-interactive stream gets at most one progress line this often


def is_live(stream: TextIO) -> bool:
    """Whether a bar can redraw itself: tqdm.auto picked its notebook widget, or the stream is a terminal."""
    from tqdm.auto import tqdm

    if any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__):
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LogLines:
    """The part of tqdm's interface used here (`n`, `update`, `set_postfix_str`, `close`) as plain lines: one
    once `delay` seconds have passed, then at most one every `every` seconds, and the final state at close
    when it was not the last line shown (nothing at all for work shorter than `delay`)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "it", file: TextIO | None = None,
                 delay: float = 0.0, every: float | None = None):
        self.desc, self.total, self.unit, self.file = desc, total, unit, file or sys.stderr
        self.delay, self.every = delay, LOG_EVERY_S if every is None else every
        self.n, self.postfix, self.start = 0, "", time.monotonic()
        self.shown_at: float | None = None
        self.shown: tuple[int, str] | None = None

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe_show()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s
        if refresh:
            self._maybe_show()

    def close(self) -> None:
        if self.shown is not None and self.shown != (self.n, self.postfix):
            self._show(time.monotonic())

    def _maybe_show(self) -> None:
        now = time.monotonic()
        if now - self.start >= self.delay and (self.shown_at is None or now - self.shown_at >= self.every):
            self._show(now)

    def _show(self, now: float) -> None:
        count = f"{self.n}/{self.total} {self.unit}" if self.total else ""
        parts = [p for p in (count, self.postfix) if p]
        self.file.write(f"{self.desc}: {', '.join(parts)} [{now - self.start:.0f}s]\n")
        self.file.flush()
        self.shown_at, self.shown = now, (self.n, self.postfix)


def progress_bar(desc: str, total: int | None = None, unit: str = "it", enabled: bool = True, delay: float = 0.0,
                 bar_format: str | None = None, file: TextIO | None = None) -> Any:
    """A tqdm.auto bar where the stream is live, else LogLines (same calls: update, set_postfix_str, close)."""
    file = file or sys.stderr
    if enabled and not is_live(file):
        return LogLines(desc, total, unit, file, delay)
    from tqdm.auto import tqdm

    return tqdm(desc=desc, total=total, unit=unit, disable=not enabled, delay=delay, file=file,
                bar_format=bar_format)


class ProgressBar(Callback):
    """A bar over rounds, a hook of the run: opened at the first evaluation after the start, so errors print before
    any bar."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __call__(self, rnd: int, rows: list[dict]) -> None:
        if self.bar is None:
            self.bar = progress_bar("rounds", self.total, "rnd", self.enabled)
        losses = [r["train_loss"] for r in rows if r["train_loss"] is not None]
        self.bar.set_postfix_str(f"train_loss={sum(losses) / max(len(losses), 1):.4g}", refresh=False)
        self.bar.update(rnd - self.bar.n)  # a live bar redraws at most every 0.1 s, and at close

    def on_evaluation(self, context: RoundContext) -> None:
        if context.round > 0:
            self(context.round, context.rows)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def echo(line: str) -> None:
    """A progress line of a command (a study's trials, a sweep's runs) on stdout, at once; library calls send
    theirs to a logger instead."""
    print(line, flush=True)
