"""The compact exact sums (harness/core/exact_sum.py) against float64 sums of the same terms: on W1, on
SCAFFOLD's control variates and on the CNN (float32, MNIST-shaped images), each round's sums agree to the
documented precision (K g / 2 < 2^(2 + 2 bitlength(K) - 53) of the largest value of the tensor each sum updates, per
block: 2^-43 at K = 10), the grid's step is the documented one exactly, and any split of the terms gives the same
bits."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fedharness.assembly.build import build_parts
from fedharness.config.load import load_settings
from fedharness.core.engine import Engine
from fedharness.core.exact_sum import BLOCK, ExactSum, Grid
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import build_executor, execute
from fakes import fake_mnist

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

W1 = ["dataset.samples_per_client=200", "dataset.num_clients=100", "algorithm.clients_per_round=10",
      "algorithm.local_steps=20", "algorithm.batch_size=24", "algorithm.client_lr=0.05"]
WORKLOADS = {"w1": W1, "scaffold": [*W1, "algorithm=scaffold", "dtype=float64"],
             "cnn": ["dataset=mnist", "dataset.num_clients=6", "model=cnn", "algorithm.clients_per_round=3",
                     "algorithm.local_steps=2", "algorithm.batch_size=8", "algorithm.client_lr=0.05"]}


def documented_bound(K: int) -> float:
    """A round's sum moves by at most K g / 2 < 2^(e + MARGIN_BITS + 2 bitlength(K) - 54) (exact_sum.py), and the
    block's largest reference value is at least 2^(e - 1): relative to it, 2^(2 + 2 bitlength(K) - 53), 2^-43 at
    K = 10."""
    return 2.0 ** (2 + 2 * K.bit_length() - 53)


def block_max(reference: torch.Tensor) -> torch.Tensor:
    """Each element's block maximum of |reference| (at least 2^-20, the grid's floor)."""
    ref = torch.nn.functional.pad(reference.abs().double(), (0, -reference.shape[1] % BLOCK))
    ref = ref.view(ref.shape[0], -1, BLOCK).amax(-1).clamp_min(2.0 ** -20)
    return ref.repeat_interleave(BLOCK, dim=1)[:, :reference.shape[1]]


def workload_settings(workload: str, folder: Path):
    """The settings of a workload; the CNN's MNIST-shaped images are written to `folder` first."""
    data = []
    if workload == "cnn":
        fake_mnist(folder / "mnist" / "MNIST" / "raw", 120, 20, gz=False)
        data = [f"dataset.data_dir={folder / 'mnist'}"]
    return load_settings([*WORKLOADS[workload], *data, "progress=false", "threads=1"])


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_compact_sums_match_float64_sums_to_the_documented_precision(workload, tmp_path):
    cfg = workload_settings(workload, tmp_path)
    problem, algorithm = build_parts(cfg)
    exact, floats = InlineExecutor(problem, algorithm.solver), InlineExecutor(problem, algorithm.solver, 1, False)
    engine = Engine(problem, algorithm, exact, rounds=10, seed=0, replicas=1, eval_every=10**9)
    state = engine.initial_state()
    for _ in range(6):
        plan, _ = engine.plan_round(state.round)
        plan.server_ctx = state.server_ctx
        for mine_shard, their_shard in zip(exact.shards, floats.shards):  # the same client slots (SCAFFOLD's c_i)
            their_shard.store = copy.deepcopy(mine_shard.store)
        mine, theirs = exact.local_updates(state.x, plan), floats.local_updates(state.x, plan)
        references = {"delta": state.x, **state.server_ctx}
        for name, value in {"delta": mine.delta, **mine.extras}.items():
            other = theirs.delta if name == "delta" else theirs.extras[name]
            K = cfg.algorithm.clients_per_round
            bound = documented_bound(K) * block_max(references[name]) + 1e-15 * other.abs().max()  # + float64's
            assert bool(((value - other).abs() <= bound).all()), name
        state = engine.step(state)


def test_any_split_of_a_rounds_terms_gives_the_same_bits():
    rng = np.random.default_rng(0)
    reference = torch.as_tensor(rng.normal(size=(2, 3000)))
    terms = torch.as_tensor(rng.normal(size=(40, 3000)) * 10.0 ** rng.integers(-8, 2, size=(40, 3000)))
    terms[5, :7] = 1e9  # beyond the low word: a second word, still exact
    index = torch.as_tensor(rng.integers(0, 2, size=40))
    grid = Grid.of(reference, 40)
    whole = ExactSum.zeros((2, 3000)).add_rows(index, terms, grid)
    assert whole.high is not None
    for trial in range(4):
        perm = rng.permutation(40)
        parts = [ExactSum.zeros((2, 3000)).add_rows(index[p], terms[p], grid)
                 for p in np.array_split(perm, trial + 2)]
        total = parts.pop()
        for part in parts:
            total.add(part)
        assert torch.equal(total.value(grid), whole.value(grid))


@pytest.mark.parametrize("sums", ["exact", "float"])
def test_the_sums_switch_reaches_the_executor_and_runs_records_it(run_config, sums):
    cfg = run_config("dataset.num_clients=6", "dataset.samples_per_client=20", "rounds=2", f"sums={sums}")
    problem, algorithm = build_parts(cfg)
    for executor in ("inline", "loop"):
        built = build_executor(cfg.replace(executor=executor), problem, algorithm.solver)
        assert all(shard.exact_sums == (sums == "exact") for shard in built.shards)
    assert execute(cfg).status == "ok"
    row = pq.read_table(cfg.results_dir + "/runs").to_pylist()[0]
    assert row["split_invariant"] == (sums == "exact") and json.loads(row["config_json"])["sums"] == sums


# --- the grid, exactly, and the bound at its worst case (issue 35) ----------------------------------------

# g = 2^(e + MARGIN_BITS - L), L = 53 - bitlength(K), e = max(-20, the exponent with max |reference| < 2^e): the
# scale 1 / g of each block, written out. At K = 10 (L = 49): 0.5 and 0.75 have e = 0, 1.0 has e = 1, 3.0 e = 2,
# 1e-7 (below 2^-20) and 0 the floor e = -20.
SCALES_AT_K10 = {0.5: 2.0 ** 47, 0.75: 2.0 ** 47, 1.0: 2.0 ** 46, 3.0: 2.0 ** 45, 1e-7: 2.0 ** 67, 0.0: 2.0 ** 67}


def test_the_grids_step_is_the_documented_one_exactly():
    for largest, scale in SCALES_AT_K10.items():  # one block a row (dim <= BLOCK)
        reference = torch.tensor([[0.1 * largest, -largest, 0.0], [largest / 3, largest, 0.0]], dtype=torch.float64)
        grid = Grid.of(reference, 10)
        assert (grid.low_bits, grid.high_bits) == (49, 49)
        assert grid.scale.tolist() == [[scale], [scale]], largest
    ones = torch.full((1, 5), 0.75, dtype=torch.float64)
    assert Grid.of(ones, 3).scale.item() == 2.0 ** 49 and Grid.of(ones, 16).scale.item() == 2.0 ** 46  # L = 51, 48
    # several blocks a row: each block its own step (the last block shorter)
    blocks = [[0.75, -1.0, 0.0], [3.0, 1e-7, -0.5]]
    reference = torch.zeros(2, 3000, dtype=torch.float64)
    for r, row in enumerate(blocks):
        for b, largest in enumerate(row):
            reference[r, b * BLOCK + 7] = largest
    scale = Grid.of(reference, 10).scale
    for r, row in enumerate(blocks):
        for b, largest in enumerate(row):
            assert set(scale[r, b * BLOCK:(b + 1) * BLOCK].tolist()) == {SCALES_AT_K10[abs(largest)]}, (r, b)


def worst_case_terms(g: float, width: int) -> torch.Tensor:
    """Ten copies of one term per coordinate j < 6: base + 0.49 2^j g, base on every grid up to 2^6 g. On a grid
    of step 2^j g, coordinate j's ten roundings all go the same way by 0.49 2^j g; on the grid of step g, no
    coordinate's by more than 0.49 g."""
    base = round(0.3 / (64 * g)) * 64 * g
    terms = torch.zeros(10, width, dtype=torch.float64)
    terms[:, :6] = torch.tensor([base + 0.49 * 2 ** j * g for j in range(6)], dtype=torch.float64)
    return terms


@pytest.mark.parametrize("width", [6, 2 * BLOCK])
def test_a_rounds_sum_stays_within_the_documented_bound_at_its_worst_case(width):
    """K = 10 terms a coordinate, the block's largest reference value 0.5 (g = 2^-47): each coordinate's sum within
    2^-43 of 0.5 of the exact sum of its terms (at most 4.9 g: the bound's 8 g less its slack); a grid 2x coarser
    moves coordinate 1 by 9.8 g, one 16x coarser coordinate 4 by 78 g."""
    reference = torch.full((1, width), 0.25, dtype=torch.float64)
    reference[0, 3] = -0.5
    if width > BLOCK:  # the terms' block has the largest value 0.5, the next one 3.0 (a step 4x coarser)
        reference[0, BLOCK:] = 3.0
    terms = worst_case_terms(2.0 ** -47, width)
    grid = Grid.of(reference, 10)
    got = ExactSum.zeros((1, width)).add_rows(torch.zeros(10, dtype=torch.int64), terms, grid).value(grid)[0]
    exact = torch.tensor([math.fsum(terms[:, j].tolist()) for j in range(6)], dtype=torch.float64)
    assert (got[:6] - exact).abs().max().item() <= documented_bound(10) * 0.5
    assert abs(got[0] - exact[0]).item() == pytest.approx(4.9 * 2.0 ** -47, rel=0.01)  # the worst case is reached
