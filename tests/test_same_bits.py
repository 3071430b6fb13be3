"""The same bits at any shard count: client contributions meet in exact sums (harness/core/exact_sum.py), so a
run's rounds/ rows are identical, not merely close, with 1 or 3 inline shards, 2 or 3 Ray shards, resumed from a
checkpoint, or with a shard killed, over 1,000 rounds (float rounding used to grow there: SCAFFOLD's control
variates differed by 11% between 1 and 3 shards)."""

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
from limb_sum import LimbSum
from fedharness.runs.execute import execute

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


FAST = {("fedavg", "float32"), ("scaffold_scheme_ii", "float64")}  # the rest run in CI (FEDHARNESS_SLOW=1)


@pytest.mark.parametrize("case,dtype", [pytest.param(c, d, marks=() if (c, d) in FAST else pytest.mark.slow)
                                        for c in CASES for d in ("float32", "float64")])
def test_one_and_three_inline_shards_give_identical_rows_over_1000_rounds(tmp_path, case, dtype):
    one = run(tmp_path, "one", *CASES[case], f"dtype={dtype}", "num_shards=1")
    three = run(tmp_path, "three", *CASES[case], f"dtype={dtype}", "num_shards=3")
    assert len(one) == 5 and one[-1][2] == 1000 and np.isfinite(one[-1][7])
    assert one == three
    assert pq.read_table(tmp_path / "runs").column("split_invariant").to_pylist() == [True, True]  # said so


def test_exact_sums_do_not_depend_on_grouping_or_order():
    """Terms spanning 80 orders of magnitude, with cancellation: any split into parts, added in any order, gives
    the same bits, and the value is the correctly rounded exact sum (checked with Python's exact fsum)."""
    rng = np.random.default_rng(0)
    terms = torch.as_tensor(rng.normal(size=(60, 3)) * 10.0 ** rng.integers(-40, 40, size=(60, 3)))
    terms[30:] = -terms[:30] * (1 + 1e-9)  # near-cancellation, as in SCAFFOLD's controls
    index = torch.zeros(60, dtype=torch.int64)
    whole = LimbSum.zeros((1, 3)).add_rows(index, terms).value()
    for trial in range(5):
        perm = torch.as_tensor(rng.permutation(60))
        cuts = sorted(rng.choice(np.arange(1, 60), size=trial + 1, replace=False))
        parts = [LimbSum.zeros((1, 3)).add_rows(index[p], terms[p]) for p in np.split(perm.numpy(), cuts)]
        total = parts.pop()
        for part in parts[::-1]:
            total.add(part)
        assert torch.equal(total.value(), whole)
    exact = [math.fsum(terms[:, j].tolist()) for j in range(3)]
    np.testing.assert_allclose(whole[0].numpy(), exact, rtol=1e-15, atol=2.0 ** -100 * 60)


def test_many_terms_in_one_row_stay_exact():
    """More terms than one float64 limb sum holds exactly (carries are normalised on the way)."""
    rng = np.random.default_rng(1)
    terms = torch.as_tensor(rng.normal(size=(12000, 2)) * 1e30)
    index = torch.zeros(12000, dtype=torch.int64)
    total = LimbSum.zeros((1, 2)).add_rows(index, terms).value()
    halves = LimbSum.zeros((1, 2)).add_rows(index[7000:], terms[7000:])
    assert torch.equal(LimbSum.zeros((1, 2)).add_rows(index[:7000], terms[:7000]).add(halves).value(), total)
    np.testing.assert_allclose(total[0].numpy(), [math.fsum(terms[:, j].tolist()) for j in range(2)], rtol=1e-15)


def test_a_term_beyond_the_limbs_saturates_the_same_way_in_any_order():
    """|x| >= 2^140 (a diverged run) counts as an infinity of its sign, so the sum is still order-independent."""
    terms = torch.tensor([[1e50, 1.0], [-3.0, 2.0 ** 141], [2.5, -1.0]], dtype=torch.float64)
    index = torch.zeros(3, dtype=torch.int64)
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        total = LimbSum.zeros((1, 2))
        for i in order:
            total.add(LimbSum.zeros((1, 2)).add_rows(index[[i]], terms[[i]]))
        assert total.value().tolist() == [[math.inf, math.inf]]


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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["fedavg", "scaffold_scheme_ii"])
def test_ray_shards_resume_and_a_killed_shard_give_the_inline_rows(local_ray, tmp_path, case, dtype):
    args = [*CASES[case], f"dtype={dtype}"]
    inline = run(tmp_path, "inline", *args)
    assert run(tmp_path, "ray2", *args, "executor=ray", "ray.num_shards=2") == inline
    assert run(tmp_path, "ray3", *args, "executor=ray", "ray.num_shards=3") == inline

    cut = load_settings([f"results_dir={tmp_path}", *SMALL, *args, "checkpoint_every=250"])
    assert execute(cut, run_id="resumed", callbacks=[StopAt(600)]).status == "stopped"
    assert execute(cut.replace(resume="resumed")).status == "ok"
    assert rows(tmp_path, "resumed") == inline

    kill = KillShardAt(500)
    settings = load_settings([f"results_dir={tmp_path}", *SMALL, *args, "executor=ray", "ray.num_shards=3"])
    assert execute(settings, run_id="killed", callbacks=[kill]).status == "ok"
    assert len(kill.pids) == 3 and rows(tmp_path, "killed") == inline


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_2nn_gives_identical_rows_on_one_and_three_shards(tmp_path, dtype):
    net = ["model=2nn", "algorithm.local_steps=5", "algorithm.batch_size=10", "algorithm.client_lr=0.05",
           f"dtype={dtype}"]
    one = run(tmp_path, "one", *net, "num_shards=1")
    assert one == run(tmp_path, "three", *net, "num_shards=3")
    assert one[-1][2] == 1000 and np.isfinite(one[-1][7])


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
