"""SCAFFOLD (option II control variates): the exact optimum of a heterogeneous quadratic at a constant
step size, where FedAvg stalls at a biased point; client state lives in the shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.core.executors import ReferenceExecutor
from quadratic_runs import run_engine

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


def test_scaffold_server_control_is_mean_of_client_controls(run_config):
    # c = (1/N) sum_i c_i holds at all times when every c_i starts at 0 and each update adds (c_i+ - c_i)/N
    res = run_engine(run_config(*HETEROGENEOUS, "algorithm=scaffold", "algorithm.sampler=scheme_i",
                                "algorithm.clients_per_round=4", "replicas=2", "rounds=7"))
    shard = res.engine.executor.shards[0]
    c_clients = sum(s["control"] for (r, k), s in shard.client_state.items() if r == 0) / 6
    torch.testing.assert_close(res.outcome.state.server_ctx["control"][0], c_clients, rtol=0, atol=1e-14)
    assert len(shard.client_state) > 6 and c_clients.abs().max() > 1e-3  # both replicas' clients, non-trivial


def test_scaffold_same_trajectory_across_shards_and_reference_loop(run_config):
    cfg = run_config(*HETEROGENEOUS, "algorithm=scaffold", "algorithm.sampler=scheme_i",
                     "algorithm.clients_per_round=4", "replicas=2", "rounds=6")
    one = run_engine(cfg).x
    three = run_engine(cfg, num_shards=3).x
    ref = run_engine(cfg, executor_cls=ReferenceExecutor).x
    np.testing.assert_allclose(one, three, atol=1e-13, rtol=0)
    np.testing.assert_allclose(one, ref, atol=1e-13, rtol=0)


def test_scaffold_doubles_the_bytes(run_config):
    rows = {}
    for name in ("fedavg", "scaffold"):
        res = run_engine(run_config(*HETEROGENEOUS, f"algorithm={name}", "algorithm.sampler=full", "rounds=3"))
        rows[name] = res.outcome.rows[-1]
    for key in ("bytes_up", "bytes_down"):
        assert rows["scaffold"][key] == 2 * rows["fedavg"][key] > 0
