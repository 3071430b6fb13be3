"""Clients with unequal tau_k: the shard trains only the clients still running (a shrinking prefix of the
batch), which must equal the masked computation (every client for max tau steps, lr 0 once finished) and
compute exactly sum_k tau_k gradient rows."""

from __future__ import annotations

from types import SimpleNamespace

import copy
import numpy as np
import pytest
import torch

from closeness import assert_close_to_scale
from fedharness.core.engine import Engine
from fedharness.core.executors import ClientShard, InlineExecutor, RoundPlan
from fedharness.contracts import ClientKeys
from fedharness.runs.execute import prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

CASES = {
    "fedavg_random_epochs": ("algorithm.local_work=random_epochs", "algorithm.epochs_low=1",
                             "algorithm.epochs_high=3", "algorithm.batch_size=16"),
    "fedprox": ("algorithm.local_work=random_steps", "algorithm.steps_low=1", "algorithm.steps_high=9",
                "algorithm.mu=0.5"),
    "momentum": ("algorithm.local_work=random_steps", "algorithm.steps_low=1", "algorithm.steps_high=9",
                 "algorithm.momentum=0.9", "algorithm.nesterov=true"),
    "scaffold": ("algorithm=scaffold", "algorithm.local_work=random_steps", "algorithm.steps_low=1",
                 "algorithm.steps_high=9"),
}


def masked_train(shard: ClientShard, x: torch.Tensor, plan: RoundPlan) -> tuple[SimpleNamespace, dict]:
    """The former path: all entries for max tau steps, lr 0 for the clients that already finished.
    Returns the reduced sums and each trained client's new state."""
    problem, solver, e = shard.problem, shard.solver, shard.entries(plan)
    w0 = x[e.replica]
    w = w0.clone()
    ctx = {k: v[e.replica] for k, v in plan.server_ctx.items()}
    state = solver.init_state(w0, ctx, shard.store.read(e.replica, e.clients, w0, ctx))
    steps = int(e.tau.max())
    batches = problem.round_batches(ClientKeys(e.clients, plan.stream_replicas[e.replica], plan.round,
                                               plan.seed), steps)
    scale = torch.as_tensor(e.lr_scale, dtype=x.dtype)[:, None]
    tau = torch.as_tensor(e.tau)[:, None]
    for t in range(steps):
        solver.update(w, problem.grad(w, batches, t), scale * float(plan.step_lrs[t]) * (t < tau), state)
    lr_sum = scale[:, 0].double() * torch.as_tensor(np.cumsum(plan.step_lrs)[e.tau - 1], dtype=torch.float64)
    new_state, extras = solver.finish(w0, w, lr_sum, state, torch.as_tensor(problem.weights[e.clients]))
    index = torch.as_tensor(e.replica)
    delta = torch.zeros(x.shape, dtype=torch.float64).index_add_(
        0, index, (w - w0).double() * torch.as_tensor(e.coef)[:, None])
    clients = [(int(r), int(k)) for r, k in zip(e.replica, e.clients)]
    return (SimpleNamespace(delta=delta, extras={k: torch.zeros_like(delta).index_add_(0, index, v)
                                                 for k, v in extras.items()}),
            {key: {name: v[i] for name, v in new_state.items()} for i, key in enumerate(clients)})


def _after_rounds(cfg, rounds: int):
    """An engine run for `rounds` rounds (SCAFFOLD's controls become non-zero) and the plan of the next round."""
    problem, algorithm, _ = prepare(cfg)
    executor = InlineExecutor(problem, algorithm.solver)
    engine = Engine(problem, algorithm, executor, rounds=rounds, seed=cfg.seed, replicas=cfg.replicas,
                    eval_every=rounds)
    state = engine.run().state
    plan, _ = engine.plan_round(state.round)
    plan.server_ctx = state.server_ctx
    return executor.shards[0], state.x, plan


@pytest.mark.parametrize("case", CASES)
def test_shrinking_batch_equals_masked_and_computes_sum_tau_rows(run_config, case):
    cfg = run_config("dataset.num_clients=12", "algorithm.clients_per_round=6", "replicas=2", "dtype=float64",
                     "algorithm.client_lr=0.1", *CASES[case])
    shard, x, plan = _after_rounds(cfg, 2)
    entries = shard.entries(plan)
    assert len(np.unique(entries.tau)) > 2  # unequal local work: the batch really shrinks
    before = copy.deepcopy(shard.store)  # the slots before the fast path writes them
    rows = []

    def counting_grad(w, batches, step):
        rows.append(len(w))
        return shard.problem.grad(w, batches, step)

    fast = shard.train_entries(x, plan, entries, counting_grad)
    fast_state = shard.get_state()
    shard.store = before
    slow, slow_state = masked_train(shard, x, plan)
    assert sum(rows) == entries.tau.sum() < len(entries.tau) * entries.tau.max()
    assert_close_to_scale(fast.delta, slow.delta, rtol=1e-12)
    assert fast.delta.abs().max() > 1e-3
    assert fast.extras.keys() == slow.extras.keys() == ({"control"} if case == "scaffold" else set())
    for name in fast.extras:
        assert_close_to_scale(fast.extras[name], slow.extras[name], rtol=1e-12)
    for key, saved in slow_state.items():  # SCAFFOLD's new c_i of every trained client
        for name, value in saved.items():
            assert_close_to_scale(fast_state[key][name], value, rtol=1e-12)
