"""The batch of slots' driver side in few calls (harness/core/slots.py, harness/core/engine.py): alike slots' server
steps, step sizes and weight statistics in one call over their rows, and a round's distinct-client counts in one
sort; each equal, bit for bit, to the slot-by-slot computation it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.algorithms.schedules import Constant, InverseStep
from fedharness.algorithms.server import ServerMomentum, ServerSGD
from fedharness.algorithms.solvers import LocalSGD
from fedharness.contracts import Algorithm
from fedharness.core.planning import trained_clients
from fedharness.core.slots import SlotServer, SlotSet, SlotSolver


def slot_set(servers=None, solvers=None, schedules=None, replicas=None) -> SlotSet:
    parts = servers or solvers or schedules
    n = len(parts)
    algorithms = [Algorithm("fedavg", None, None, (schedules or [None] * n)[i], (solvers or [None] * n)[i], None,
                            (servers or [None] * n)[i], 8) for i in range(n)]
    replicas = np.array(replicas or [1] * n)
    return SlotSet(list(range(n)), algorithms, np.zeros(n, dtype=np.int64), replicas, np.full(n, 10),
                   np.full(n, 2), {})


def test_trained_clients_counts_each_client_once_at_its_first_draw():
    clients = np.array([[3, 1, 3, 2], [0, 0, 0, 0], [5, 4, 5, 4]])
    coef = np.array([[0.25, 0.25, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.5]])
    tau = np.array([[7, 2, 9, 4], [1, 1, 1, 1], [3, 8, 6, 5]])
    distinct, work = trained_clients(clients, coef, tau)
    # row 0: clients 3 (first draw tau 7) and 1 (tau 2); client 2 dropped out. Row 1: nobody. Row 2: client 5 (tau 3)
    # and client 4 (its first returning draw, tau 5: the draw with coefficient 0 does not train)
    assert distinct.tolist() == [2, 0, 2]
    assert work.tolist() == [9, 0, 8]


def test_trained_clients_equals_unique_row_by_row():
    rng = np.random.default_rng(5)
    clients, tau = rng.integers(0, 9, (40, 12)), rng.integers(1, 30, (40, 12))
    coef = rng.random((40, 12)) * (rng.random((40, 12)) > 0.25)
    distinct, work = trained_clients(clients, coef, tau)
    for r in range(40):
        ids, first = np.unique(clients[r][coef[r] != 0], return_index=True)
        assert distinct[r] == len(ids)
        assert work[r] == tau[r][coef[r] != 0][first].sum()


@pytest.mark.parametrize("servers", [
    [ServerMomentum(1.0, 0.9), ServerMomentum(1.0, 0.9), ServerMomentum(0.5, 0.9), ServerMomentum(0.5, 0.9),
     ServerMomentum(0.5, 0.8)],
    [ServerSGD(1.0), ServerSGD(1.0), ServerSGD(0.5), ServerSGD(0.5), ServerSGD(0.7)]])
def test_alike_servers_step_in_one_call_equal_to_each_slot_alone(servers):
    slots = slot_set(servers=servers, replicas=[2, 1, 1, 3, 1])
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(size=(8, 6)), dtype=torch.float32)
    delta = torch.as_tensor(rng.normal(size=(8, 6)))
    lr = rng.uniform(0.01, 1.0, 8)  # the client step size of each row: the momentum servers divide by it
    batched = SlotServer(slots)
    assert [rows for _, rows in batched.runs] == [slice(0, 3), slice(3, 7), slice(7, 8)]  # alike: slots 0-1, 2-3
    state = batched.init_state(x)
    alone = [{k: v[slots.rows(i)].clone() for k, v in state.items()} for i in range(5)]
    for _ in range(3):  # the momentum buffers carry over: each step's state lands in the batch's rows
        got = batched.step(x, delta, state, lr)
        want = torch.cat([s.step(x[slots.rows(i)], delta[slots.rows(i)], alone[i], lr[slots.rows(i)])
                          for i, s in enumerate(servers)])
        assert torch.equal(got, want)
        for i in range(5):
            for k, v in alone[i].items():
                assert torch.equal(state[k][slots.rows(i)], v)
        x = got


def test_plain_sgd_weight_stats_by_row_equal_each_row_alone():
    """Each row's own step sizes [R, T] give the bits of the [T] call: constant steps (the [T] call's shortcut) and
    steps decaying within the round (its prefix sums)."""
    solver = LocalSGD()
    assert solver.rows_of_step_sizes and not LocalSGD(momentum=0.5).rows_of_step_sizes
    rng = np.random.default_rng(1)
    tau = rng.integers(1, 13, (6, 4))
    lrs = np.stack([Constant(0.3).step_lrs(0, 12), Constant(0.017).step_lrs(0, 12),
                    InverseStep(1.0, 3.0, 12).step_lrs(2, 12), InverseStep(0.2, 7.0, 12).step_lrs(0, 12),
                    Constant(1e-3).step_lrs(0, 12), InverseStep(5.0, 1.0, 12).step_lrs(9, 12)])
    scale = rng.uniform(0.5, 2.0, (6, 4))
    got = solver.weight_stats(tau, lrs, scale)
    for r in range(6):
        want = solver.weight_stats(tau[r:r + 1], lrs[r][:int(tau[r].max())], scale[r:r + 1])
        for name in ("l1", "l2sq", "last", "scale"):
            assert np.array_equal(getattr(got, name)[r:r + 1], getattr(want, name)), (r, name)
    constant = solver.weight_stats(tau[:2], lrs[:2])
    assert np.array_equal(constant.l1, tau[:2].astype(np.float64)) and np.array_equal(constant.last, np.ones((2, 4)))


def test_a_subclass_with_its_own_step_sizes_is_asked_slot_by_slot():
    """A user's LocalSGD subclass that overrides step_lrs or weight_stats for [T] only never gets [R, T]: the
    batched call is LocalSGD's own methods' promise, not its subclasses'."""
    class Halved(LocalSGD):
        def step_lrs(self, base_lrs):
            assert np.ndim(base_lrs) == 1, "handed [R, T]"
            return super().step_lrs(base_lrs) / 2

    class Counted(LocalSGD):
        def weight_stats(self, tau, step_lrs, lr_scale=None):
            assert np.ndim(step_lrs) == 1, "handed [R, T]"
            return super().weight_stats(tau, step_lrs, lr_scale)

    assert not Halved().rows_of_step_sizes and not Counted().rows_of_step_sizes and LocalSGD().rows_of_step_sizes
    solvers = [Halved(), Halved(), Counted(), Counted()]
    schedules = [Constant(0.1), Constant(0.3), Constant(0.2), Constant(0.4)]
    slots = slot_set(solvers=solvers, schedules=schedules, replicas=[1, 2, 1, 1])
    batched = SlotSolver(slots, LocalSGD())
    base = slots.per_row(np.stack([s.step_lrs(0, 4) for s in schedules]))
    lrs = batched.step_lrs(base)
    batched.weight_stats(np.full((5, 3), 4), lrs, None)
    assert np.array_equal(lrs[0], np.full(4, 0.05)) and np.array_equal(lrs[2], np.full(4, 0.15))


def test_slot_solver_equals_each_slot_alone():
    """Plain SGD slots (one call over their rows) and momentum slots (slot by slot) side by side: step sizes and
    weight statistics as each slot's own solver gives them."""
    solvers = [LocalSGD(), LocalSGD(), LocalSGD(lr_decay=0.9), LocalSGD(momentum=0.5), LocalSGD()]
    schedules = [Constant(0.1), Constant(0.05), Constant(0.2), Constant(0.1), InverseStep(1.0, 4.0, 5)]
    slots = slot_set(solvers=solvers, schedules=schedules, replicas=[1, 2, 1, 2, 1])
    batched = SlotSolver(slots, LocalSGD(momentum=0.5))
    assert [rows for _, rows in batched.runs] == [slice(0, 3), slice(3, 4), slice(4, 6), slice(6, 7)]
    rng = np.random.default_rng(2)
    tau = rng.integers(1, 8, (7, 3))
    base = slots.per_row(np.stack([s.step_lrs(3, 7) for s in schedules]))
    lrs = batched.step_lrs(base)
    stats = batched.weight_stats(tau, lrs, None)
    for i, solver in enumerate(solvers):
        rows = slots.rows(i)
        own = solver.step_lrs(schedules[i].step_lrs(3, 7))
        assert all(np.array_equal(lrs[r], own) for r in range(rows.start, rows.stop))
        want = solver.weight_stats(tau[rows], own[:int(tau[rows].max())])
        for name in ("l1", "l2sq", "last", "scale"):
            assert np.array_equal(getattr(stats, name)[rows], getattr(want, name)), (i, name)
