"""A round's minibatches are gathered into one buffer that each chunk of steps reuses: every step still reads its own
samples, and the buffer is allocated once per round (a fresh one each step made the allocator fault pages in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closeness import assert_close_to_scale
from fedharness.contracts import ClientKeys
from fedharness.problems import data
from fedharness.problems.data import DataProblem
from fedharness.problems.objectives import SoftmaxRegression

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

FEATURES, CLASSES, SAMPLES, CLIENTS, STEPS, BATCH = 5, 3, 200, 4, 6, 8


def test_each_step_reads_its_own_samples_through_one_buffer(monkeypatch):
    monkeypatch.setattr(data, "GATHER_ELEMENTS", 2 * CLIENTS * BATCH * (FEATURES + 1))  # chunks of 2 steps
    rng = np.random.default_rng(0)
    problem = DataProblem(SoftmaxRegression((FEATURES,), CLASSES, 0.0), rng.normal(size=(SAMPLES, FEATURES)),
                          rng.integers(0, CLASSES, SAMPLES), np.array_split(np.arange(SAMPLES), CLIENTS), None,
                          None, batch_size=BATCH, dtype=torch.float64)
    keys = ClientKeys(np.arange(CLIENTS), np.zeros(CLIENTS, dtype=np.int64), 2, 0)
    batches = problem.round_batches(keys, STEPS)
    assert batches.chunk_steps == 2
    w = torch.randn(CLIENTS, problem.dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    buffers = set()
    for step in range(STEPS):
        m = CLIENTS - step // 3  # the prefix shrinks as in a round with unequal local steps
        got = problem.grad(w[:m], batches, step)
        buffers.add(batches.rows.data_ptr())
        rows = batches.index[:m, step]
        chunk = problem.objective.prepare_chunk(problem.x[rows][:, None], problem.y[rows][:, None])  # one step
        want = problem.objective.batch_grad(w[:m], tuple(part[:, 0] for part in chunk))
        assert_close_to_scale(got, want, 1e-12)  # a view of a chunk, not a fresh tensor: rounding may differ
    assert len(buffers) == 1
