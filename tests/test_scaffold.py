"""SCAFFOLD (option II control variates): the exact optimum of a heterogeneous quadratic at a constant
step size, where FedAvg stalls at a biased point; client state lives in the shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor, LoopExecutor
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.assembly.build import algorithm_for
from fedharness.runs.execute import prepare
from quadratic_runs import run_engine

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

HETEROGENEOUS = ("dataset=quadratic", "dataset.num_clients=6", "dataset.dim=3", "dataset.curvature=random",
                 "dataset.mu=0.5", "dataset.L=2.0", "dataset.spread=2.0", "algorithm.local_steps=5",
                 "algorithm.client_lr=0.05", "dtype=float64", "rounds=400")


@pytest.mark.parametrize("participation", [
    ("algorithm.sampler=full",),
    ("algorithm.sampler=scheme_ii", "algorithm.clients_per_round=3", "replicas=2"),
    ("algorithm.sampler=full", "algorithm.local_work=per_client", "algorithm.client_steps=[1,2,3,5,8,13]"),
])
def test_scaffold_reaches_exact_optimum_with_constant_step(run_config, participation):
    scaffold = run_engine(run_config(*HETEROGENEOUS, "algorithm=scaffold", *participation))
    fedavg = run_engine(run_config(*HETEROGENEOUS, *participation))
    w_star = scaffold.reference.w_star
    assert np.abs(scaffold.x - w_star).max() < 1e-8
    assert np.linalg.norm(fedavg.x - w_star, axis=1).min() > 1e-2  # the heterogeneity bias SCAFFOLD removes


UNEQUAL_P = np.array([0.4, 0.05, 0.25, 0.1, 0.15, 0.05])


def _run_weighted(cfg, rounds: int) -> tuple[np.ndarray, np.ndarray, Engine, object]:
    """The HETEROGENEOUS quadratic with unequal client weights p_k: final iterates, w* of sum p_k F_k."""
    base, _, _ = prepare(cfg)
    problem = QuadraticProblem(base.A_np, base.e_np, UNEQUAL_P, dtype=torch.float64)
    algorithm = algorithm_for(cfg, problem)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=rounds, seed=cfg.seed,
                    replicas=cfg.replicas, eval_every=rounds)
    outcome = engine.run()
    return outcome.state.x.numpy(), problem.optimum(), engine, outcome


@pytest.mark.parametrize("participation", [
    ("algorithm.sampler=full",),
    ("algorithm.sampler=scheme_i", "algorithm.clients_per_round=3", "replicas=2"),
    ("algorithm.sampler=scheme_ii", "algorithm.clients_per_round=3", "replicas=2"),
])
def test_scaffold_reaches_weighted_optimum_with_unequal_weights(run_config, participation):
    # c = sum p_k c_k makes every corrected client stationary at w* of sum p_k F_k (an unweighted c stops
    # at the optimum of (1/N) sum F_k instead, about 1 away here)
    cfg = run_config(*HETEROGENEOUS, "algorithm=scaffold", *participation)
    x, w_star, _, _ = _run_weighted(cfg, 600)
    base, _, _ = prepare(cfg)
    assert np.linalg.norm(base.optimum() - w_star) > 0.1  # the weights matter on this problem
    assert np.linalg.norm(x - w_star, axis=1).max() < 1e-10


def test_scaffold_server_control_is_weighted_sum_of_client_controls(run_config):
    # c = sum_i p_i c_i holds at all times when every c_i starts at 0 and each update adds p_i (c_i+ - c_i)
    cfg = run_config(*HETEROGENEOUS, "algorithm=scaffold", "algorithm.sampler=scheme_i",
                     "algorithm.clients_per_round=4", "replicas=2", "rounds=7")
    _, _, engine, outcome = _run_weighted(cfg, 7)
    shard = engine.executor.shards[0]
    c_clients = sum(UNEQUAL_P[k] * s["control"] for (r, k), s in shard.get_state().items() if r == 0)
    torch.testing.assert_close(outcome.state.server_ctx["control"][0], c_clients, rtol=1e-12, atol=0)
    assert len(shard.get_state()) > 6 and c_clients.abs().max() > 1e-3  # both replicas' clients, non-trivial


def test_scaffold_same_trajectory_across_shards_and_reference_loop(run_config):
    cfg = run_config(*HETEROGENEOUS, "algorithm=scaffold", "algorithm.sampler=scheme_i",
                     "algorithm.clients_per_round=4", "replicas=2", "rounds=6")
    one = run_engine(cfg).x
    three = run_engine(cfg, num_shards=3).x
    ref = run_engine(cfg, executor_cls=LoopExecutor).x
    np.testing.assert_allclose(one, three, atol=1e-13, rtol=0)
    np.testing.assert_allclose(one, ref, atol=1e-13, rtol=0)


def test_scaffold_doubles_the_bytes(run_config):
    rows = {}
    for name in ("fedavg", "scaffold"):
        res = run_engine(run_config(*HETEROGENEOUS, f"algorithm={name}", "algorithm.sampler=full", "rounds=3"))
        rows[name] = res.outcome.rows[-1]
    for key in ("bytes_up", "bytes_down"):
        assert rows["scaffold"][key] == 2 * rows["fedavg"][key] > 0
