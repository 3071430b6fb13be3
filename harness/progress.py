"""Progress on long work: a bar over the rounds of a run, on stderr; the command line's progress lines."""

from __future__ import annotations

import sys


class ProgressBar:
    """A tqdm bar over rounds, opened at the first evaluation so errors print before any bar."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __call__(self, rnd: int, rows: list[dict]) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=self.total, desc="rounds", unit="rnd", disable=not self.enabled, file=sys.stderr)
        losses = [r["train_loss"] for r in rows if r["train_loss"] is not None]
        self.bar.n = rnd
        self.bar.set_postfix(train_loss=f"{sum(losses) / max(len(losses), 1):.4g}")
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def echo(line: str) -> None:
    """A progress line of a command (a study's trials, a sweep's runs) on stdout, at once; library calls send
    theirs to a logger instead."""
    print(line, flush=True)
