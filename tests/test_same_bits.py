"""The same bits at any shard count: client contributions meet in exact sums (harness/core/exact_sum.py), so a
run's rounds/ rows are identical, not merely close, with 1 or 3 inline shards over 1,000 rounds, and with 2 or 3
Ray shards, resumed from a checkpoint, or with a shard killed, over 400 rounds (float rounding used to grow over 1,000 rounds: SCAFFOLD's control
variates differed by 11% between 1 and 3 shards); the unit tests of exactness run on the product's sums, beside
the former 240-bit sums (tests/limb_sum.py) as their oracle."""

from __future__ import annotations

import math
import os
import signal

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from fedharness.config.load import load_settings
from fedharness.contracts import Callback
from fedharness.core.exact_sum import ExactSum, Grid
from fedharness.runs.execute import execute
from limb_sum import LimbSum

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

SMALL = ["dataset.num_clients=30", "algorithm.clients_per_round=10", "eval_every=250", "rounds=1000",
         "reference=off", "heterogeneity=false", "threads=1", "progress=false"]
CASES = {
    "fedavg": [],
    "fednova_random_epochs": ["algorithm=fednova", "algorithm.local_work=random_epochs", "algorithm.epochs_low=1",
                              "algorithm.epochs_high=2", "algorithm.batch_size=48"],
    "scaffold_scheme_i": ["algorithm=scaffold"],
    "scaffold_scheme_ii": ["algorithm=scaffold", "algorithm.sampler=scheme_ii"],
}
COLUMNS = ("replica", "series", "round", "local_steps", "grad_evals", "bytes_up", "bytes_down", "train_loss",
           "grad_norm_sq", "test_loss", "test_acc", "lr", "tau_eff", "chi2")  # all but the wall clock


def rows(results_dir, run_id: str) -> list[tuple]:
    table = pq.read_table(results_dir / "rounds" / f"run_id={run_id}", columns=list(COLUMNS)).to_pylist()
    return sorted(tuple(r[c] for c in COLUMNS) for r in table)


def run(tmp_path, run_id: str, *overrides: str) -> list[tuple]:
    settings = load_settings([f"results_dir={tmp_path}", *SMALL, *overrides])
    assert execute(settings, run_id=run_id).status == "ok"
    return rows(tmp_path, run_id)


FAST = {("fedavg", "float32"), ("scaffold_scheme_ii", "float64")}  # in the default run over 100 rounds


def _one_and_three_shards(tmp_path, case: str, dtype: str, rounds: int) -> None:
    every = rounds // 4
    length = (f"rounds={rounds}", f"eval_every={every}")
    one = run(tmp_path, "one", *CASES[case], f"dtype={dtype}", "num_shards=1", *length)
    three = run(tmp_path, "three", *CASES[case], f"dtype={dtype}", "num_shards=3", *length)
    assert len(one) == 5 and one[-1][2] == rounds and np.isfinite(one[-1][7])
    assert one == three
    assert pq.read_table(tmp_path / "runs").column("split_invariant").to_pylist() == [True, True]  # said so


@pytest.mark.slow  # CI (FEDHARNESS_SLOW=1): 1,000 rounds, every case; the default run has FAST over 100 rounds
@pytest.mark.parametrize("case,dtype", [(c, d) for c in CASES for d in ("float32", "float64")])
def test_one_and_three_inline_shards_give_identical_rows_over_1000_rounds(tmp_path, case, dtype):
    _one_and_three_shards(tmp_path, case, dtype, 1000)


@pytest.mark.parametrize("case,dtype", sorted(FAST))
def test_one_and_three_inline_shards_give_identical_rows_over_100_rounds(tmp_path, case, dtype):
    _one_and_three_shards(tmp_path, case, dtype, 100)


def test_shards_of_one_client_give_the_rows_of_one_shard_on_synthetic_with_batch_8(tmp_path):
    """4 of 12 clients a round on 3 shards: shards of one client, and clients at other batch positions than on 1
    shard; batch 8 is where MKL's small GEMM summed by its operands' alignment (tests/test_batch_position.py).
    The rows differed from round 1 in the ~9th digit of train_loss."""
    case = ["dataset=synthetic", "dataset.num_clients=12", "algorithm.sampler=yang_s2", "algorithm.clients_per_round=4",
            "algorithm.local_steps=3", "algorithm.batch_size=8", "rounds=6", "eval_every=1"]
    one = run(tmp_path, "one", *case, "num_shards=1")
    three = run(tmp_path, "three", *case, "num_shards=3")
    assert len(one) == 7 and np.isfinite(one[-1][7])
    assert one == three


def on_grid(terms: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The terms rounded to a one-block grid's step (a power of two: exact), as the product rounds each term."""
    return torch.round(terms * grid.scale) / grid.scale


def split_sums(index: torch.Tensor, terms: torch.Tensor, grid: Grid, parts: list) -> torch.Tensor:
    """The product's sum of the terms taken in `parts` (index lists), each part its own partial sum, merged in
    the order given."""
    sums = [ExactSum.zeros((1, terms.shape[1])).add_rows(index[p], terms[p], grid) for p in parts]
    total = sums.pop()
    for part in sums[::-1]:
        total.add(part)
    return total.value(grid)


def test_exact_sums_do_not_depend_on_grouping_or_order():
    """The product (harness/core/exact_sum.py) on terms spanning 30 orders of magnitude, with cancellation: any
    split into parts, added in any order, gives the same bits, and the value is the correctly rounded sum of the
    terms on its grid (Python's exact fsum), as the 240-bit oracle (tests/limb_sum.py) sums them."""
    rng = np.random.default_rng(0)
    terms = torch.as_tensor(rng.normal(size=(60, 3)) * 10.0 ** rng.integers(-16, 14, size=(60, 3)))
    terms[30:] = -terms[:30] * (1 + 1e-9)  # near-cancellation, as in SCAFFOLD's controls
    index = torch.zeros(60, dtype=torch.int64)
    grid = Grid.of(torch.ones(1, 3, dtype=torch.float64), 60)  # step 2^-44, words to 2^50
    whole = split_sums(index, terms, grid, [np.arange(60)])
    for trial in range(5):
        perm = rng.permutation(60)
        cuts = sorted(rng.choice(np.arange(1, 60), size=trial + 1, replace=False))
        assert torch.equal(split_sums(index, terms, grid, np.split(perm, cuts)), whole)
    rounded = on_grid(terms, grid)
    # exact: no order of additions enters either side (the product's grid sum is exact, fsum's partials too)
    assert whole[0].tolist() == [math.fsum(rounded[:, j].tolist()) for j in range(3)]
    assert torch.equal(LimbSum.zeros((1, 3)).add_rows(index, rounded).value(), whole)
    oracle = LimbSum.zeros((1, 3)).add_rows(index, terms).value()  # the oracle on the terms themselves: their sum
    np.testing.assert_allclose(oracle[0].numpy(), [math.fsum(terms[:, j].tolist()) for j in range(3)], rtol=1e-15)
    assert (terms.abs() >= 2.0 ** 47 * 2.0 ** -44).any()  # some terms used the second word


def test_many_terms_in_one_row_stay_exact():
    """12,000 terms in one element: the words stay below 2^53 (L = 39 bits at that count), high words included,
    and the product equals the oracle's sum of the same grid-rounded terms."""
    rng = np.random.default_rng(1)
    terms = torch.as_tensor(rng.normal(size=(12000, 2)) * 1e30)
    index = torch.zeros(12000, dtype=torch.int64)
    grid = Grid.of(torch.full((1, 2), 3e29, dtype=torch.float64), 12000)  # step 2^62: terms above 3.4e30 go high
    assert grid.low_bits == 39
    assert ExactSum.zeros((1, 2)).add_rows(index, terms, grid).high is not None
    total = split_sums(index, terms, grid, [np.arange(12000)])
    assert torch.equal(split_sums(index, terms, grid, [np.arange(7000), np.arange(7000, 12000)]), total)
    rounded = on_grid(terms, grid)
    # exact: no order of additions enters either side (the product's grid sum is exact, fsum's partials too)
    assert total[0].tolist() == [math.fsum(rounded[:, j].tolist()) for j in range(2)]
    assert torch.equal(LimbSum.zeros((1, 2)).add_rows(index, rounded).value(), total)
    oracle = LimbSum.zeros((1, 2)).add_rows(index, terms).value()  # carries normalised on the way: still exact
    np.testing.assert_allclose(oracle[0].numpy(), [math.fsum(terms[:, j].tolist()) for j in range(2)], rtol=1e-15)


def test_a_term_beyond_the_words_saturates_the_same_way_in_any_order():
    """The product's overflow path: a term of |n| >= 2^(2L) steps (a diverged run) counts as an infinity of its
    sign, so the sum is still order-independent; as the oracle does for terms beyond its limbs (2^140)."""
    grid = Grid.of(torch.ones(1, 2, dtype=torch.float64), 3)  # L = 51, step 2^-48: saturation from 2^54
    terms = torch.tensor([[1e50, 1.0], [-3.0, 2.0 ** 141], [2.5, -1.0]], dtype=torch.float64)
    index = torch.zeros(3, dtype=torch.int64)
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        assert split_sums(index, terms, grid, [[i] for i in order]).tolist() == [[math.inf, math.inf]]
        assert split_sums(index, terms, grid, [order]).tolist() == [[math.inf, math.inf]]
    assert LimbSum.zeros((1, 2)).add_rows(index, terms).value().tolist() == [[math.inf, math.inf]]
    # at the edge: 2^54 - 8 (n = 2^102 - 2^51) is summed exactly, 2^54 (n = 2^102) saturates; -inf and +inf give
    # NaN, a NaN term NaN, in any order
    edge = torch.tensor([[2.0 ** 54 - 8, -(2.0 ** 54)], [2.0, 3.0]], dtype=torch.float64)
    two = torch.zeros(2, dtype=torch.int64)
    assert split_sums(two, edge, grid, [[0], [1]]).tolist() == [[2.0 ** 54 - 6, -math.inf]]
    signs = torch.tensor([[math.inf, math.nan], [-1e60, 1.0]], dtype=torch.float64)
    for order in ([[0], [1]], [[1], [0]], [[0, 1]]):
        got = split_sums(two, signs, grid, order)[0]
        assert math.isnan(got[0]) and math.isnan(got[1])


# --- slow: Ray shards, resume, a killed shard, the 2NN and the CNN (CI runs them) ------------------------------



class StopAt(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_round_end(self, context):
        return context.round == self.at


class KillShardAt(Callback):
    """SIGKILLs one shard actor's process after round `at`; the executor restarts it and replays."""

    def __init__(self, at: int):
        self.at, self.pids = at, []

    def on_round_end(self, context):
        if context.round == self.at:
            from ray_support import shard_actor_pids

            self.pids = shard_actor_pids()
            os.kill(self.pids[0], signal.SIGKILL)


RAY_ROUNDS = ("rounds=200", "eval_every=50")  # the Ray path's 200 rounds (1,500 Ray rounds a case); the inline
# tests above hold the sums over 1,000 rounds, where float rounding used to grow: exact sums have no drift to grow,
# and what this test adds (Ray's shards, a resume, a killed shard) is decided in the rounds around each event


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["fedavg", "scaffold_scheme_ii"])
def test_ray_shards_resume_and_a_killed_shard_give_the_inline_rows(local_ray, tmp_path, case, dtype):
    args = [*CASES[case], f"dtype={dtype}", *RAY_ROUNDS]
    inline = run(tmp_path, "inline", *args)
    assert run(tmp_path, "ray2", *args, "executor=ray", "ray.num_shards=2") == inline
    assert run(tmp_path, "ray3", *args, "executor=ray", "ray.num_shards=3") == inline

    cut = load_settings([f"results_dir={tmp_path}", *SMALL, *args, "checkpoint_every=50"])
    assert execute(cut, run_id="resumed", callbacks=[StopAt(125)]).status == "stopped"  # resumes at 100
    assert execute(cut.replace(resume="resumed")).status == "ok"
    assert rows(tmp_path, "resumed") == inline

    kill = KillShardAt(100)
    settings = load_settings([f"results_dir={tmp_path}", *SMALL, *args, "executor=ray", "ray.num_shards=3"])
    assert execute(settings, run_id="killed", callbacks=[kill]).status == "ok"
    assert len(kill.pids) == 3 and rows(tmp_path, "killed") == inline


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_2nn_gives_identical_rows_on_one_and_three_shards(tmp_path, dtype):
    # 250 rounds: the linear models above hold the sums over 1,000; a net's rows are the same or not from the first
    # round its shards sum differently (exact sums: nothing accumulates to show later)
    net = ["model=2nn", "algorithm.local_steps=5", "algorithm.batch_size=10", "algorithm.client_lr=0.05",
           f"dtype={dtype}", "rounds=250", "eval_every=50"]
    one = run(tmp_path, "one", *net, "num_shards=1")
    assert one == run(tmp_path, "three", *net, "num_shards=3")
    assert len(one) == 6 and one[-1][2] == 250 and np.isfinite(one[-1][7])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_cnn_at_smoke_size_gives_identical_rows_on_one_and_three_shards(tmp_path, dtype):
    from fakes import fake_mnist

    fake_mnist(tmp_path / "mnist" / "MNIST" / "raw", 120, 20, gz=False)
    cnn = ["dataset=mnist", f"dataset.data_dir={tmp_path / 'mnist'}", "dataset.num_clients=6", "model=cnn",
           "algorithm.clients_per_round=3", "algorithm.local_steps=2", "algorithm.batch_size=8", "rounds=30",
           "eval_every=10", f"dtype={dtype}", "kernel=vmap"]
    one = run(tmp_path, "one", *cnn, "num_shards=1")
    assert one == run(tmp_path, "three", *cnn, "num_shards=3")
    assert one[-1][2] == 30
