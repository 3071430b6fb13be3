"""Which runs of a study train together as one batched run (fedharness.runs.batch): those whose configs are equal once
the keys a slot sets on its own are left out (batched.batch_key). `fedharness tune tune.batch=B` and
`fedharness sweep` group their runs with `group_batches`.
"""

from __future__ import annotations

from typing import Sequence

from fedharness.runs.batch import check_batch, batch_key
from fedharness.errors import ConfigError
from fedharness.settings import RunSettings


def can_batch(settings: RunSettings) -> bool:
    """Whether the run may train in a batch at all (not one that checkpoints, resumes, or couples its replicas)."""
    try:
        check_batch([settings])
    except ConfigError:
        return False
    return True


def group_batches(settings: Sequence[RunSettings], size: int) -> list[list[int]]:
    """The indexes of `settings` in batches of at most `size` runs that can train together (fedharness.runs.batch's
    batch_key), each batch in the order of its runs, the batches in the order of their first run; a run that cannot
    be batched is a batch of its own."""
    open_batch: dict[str, list[int]] = {}
    batches: list[list[int]] = []
    for index, run in enumerate(settings):
        if not can_batch(run):
            batches.append([index])
            continue
        key = batch_key(run)
        if key not in open_batch or len(open_batch[key]) >= size:
            open_batch[key] = []
            batches.append(open_batch[key])
        open_batch[key].append(index)
    return batches
