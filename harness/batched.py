"""Batched runs: several runs that differ only in batchable keys (step sizes, E, mu, momenta, schedule parameters,
seed) trained as one, one slot of the replica axis per run (docs/tuning.md, Batched trials).

Each slot is recorded as its own run in runs/ and rounds/, exactly as if run alone, plus the `batch_id` of the
batch it ran in. A slot that diverges, is pruned (its `on_eval` raises optuna.TrialPruned), fails, or finishes
its rounds leaves the batch without disturbing the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fedharness.runner import RunResult, execute, new_run_id
from fedharness.settings import RunSettings

# The keys a slot may set on its own; every other key must be equal across the slots of one batch.
BATCHABLE_KEYS = ("seed", "rounds", "algorithm.client_lr", "algorithm.server_lr", "algorithm.local_steps",
                  "algorithm.mu", "algorithm.momentum", "algorithm.server_momentum", "algorithm.schedule")


@dataclass
class Slot:
    """One run of a batch: its settings as if run alone, its run id, and its `on_eval(rows, state)` (an exception
    from it ends this slot only: status pruned for optuna.TrialPruned, else failed)."""

    settings: RunSettings
    run_id: str | None = None
    on_eval: Callable[[list[dict], Any], None] | None = None


def execute_batch(slots: Sequence[Slot], progress=None, batch_id: str | None = None) -> list[RunResult]:
    """Run the slots; one RunResult per slot, in order. (Sequential until the batched engine lands.)"""
    batch_id = batch_id or new_run_id()
    results = []
    for slot in slots:
        try:
            results.append(execute(slot.settings, progress=progress, run_id=slot.run_id, on_eval=slot.on_eval))
        except Exception:
            results.append(RunResult(slot.run_id or "", "failed", [], None))  # recorded by execute already
    return results
