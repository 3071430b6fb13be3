"""The compact exact sums (harness/core/exact_sum.py) against float64 sums of the same terms: on W1, on
SCAFFOLD's control variates and on the CNN (float32, MNIST-shaped images), each round's sums agree to the
documented precision (2^-40 of the largest value of the tensor each sum updates, per block), and any split of
the terms gives the same bits."""

from __future__ import annotations

import json
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

W1 = ["dataset.samples_per_client=200", "dataset.num_clients=100", "algorithm.clients_per_round=10",
      "algorithm.local_steps=20", "algorithm.batch_size=24", "algorithm.client_lr=0.05"]
WORKLOADS = {"w1": W1, "scaffold": [*W1, "algorithm=scaffold", "dtype=float64"],
             "cnn": ["dataset=mnist", "dataset.num_clients=6", "model=cnn", "algorithm.clients_per_round=3",
                     "algorithm.local_steps=2", "algorithm.batch_size=8", "algorithm.client_lr=0.05"]}
TOLERANCE = 2.0 ** -40  # of the block's largest reference value: the bound K^2 2^(e + 2 - 54) for K <= 16


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
        floats.set_state(exact.get_state())  # the same client state (SCAFFOLD's c_i) before both
        mine, theirs = exact.local_updates(state.x, plan), floats.local_updates(state.x, plan)
        references = {"delta": state.x, **state.server_ctx}
        for name, value in {"delta": mine.delta, **mine.extras}.items():
            other = theirs.delta if name == "delta" else theirs.extras[name]
            bound = TOLERANCE * block_max(references[name]) + 1e-15 * other.abs().max()  # + float64 sums' error
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
