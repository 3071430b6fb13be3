"""Local solvers: the weighting vectors a_i that weight_stats finds by running each solver's own
recurrence on unit gradients match Wang et al.'s closed forms (Sec. 4.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.algorithms.solvers import LocalSGD, ScaffoldSGD
from fedharness.references import closed_forms as cf

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

TAU = np.array([[1, 2, 3, 7], [10, 20, 5, 1]])


def test_plain_sgd_weights_are_ones():
    stats = LocalSGD().weight_stats(TAU, np.full(20, 0.1))
    np.testing.assert_array_equal(stats.l1, TAU)
    np.testing.assert_array_equal(stats.l2sq, TAU)
    np.testing.assert_array_equal(stats.last, 1.0)


@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_momentum_weights_match_closed_form(rho):
    # a = [1 - rho^tau, 1 - rho^(tau-1), ..., 1 - rho] / (1 - rho), buffer reset each round
    stats = LocalSGD(momentum=rho).weight_stats(TAU, np.full(20, 0.1))
    np.testing.assert_allclose(stats.l1, cf.momentum_l1(TAU, rho), rtol=1e-12)
    a = [(1 - rho ** np.arange(t, 0, -1)) / (1 - rho) for t in TAU.reshape(-1)]
    np.testing.assert_allclose(stats.l2sq.reshape(-1), [(v * v).sum() for v in a], rtol=1e-12)
    np.testing.assert_allclose(stats.last.reshape(-1), [v[-1] for v in a], rtol=1e-12)
    assert (stats.l1[TAU > 1] > TAU[TAU > 1]).all()  # momentum takes longer effective steps


@pytest.mark.parametrize("lr, mu", [(0.1, 2.0), (0.05, 0.5)])
def test_proximal_weights_match_closed_form(lr, mu):
    # a = [(1 - alpha)^(tau-1), ..., 1 - alpha, 1], alpha = lr * mu: depends on the actual step size
    stats = LocalSGD(mu=mu).weight_stats(TAU, np.full(20, lr))
    np.testing.assert_allclose(stats.l1, cf.prox_l1(TAU, lr, mu), rtol=1e-12)
    np.testing.assert_allclose(stats.last, 1.0, rtol=1e-12)
    alpha = lr * mu
    np.testing.assert_allclose(stats.l2sq, (1 - (1 - alpha) ** (2 * TAU)) / (1 - (1 - alpha) ** 2), rtol=1e-12)


def test_proximal_weights_follow_each_clients_lr_scale():
    # a client training at twice the step size has alpha = 2 lr mu (transformed scheme II, RR's 2 gamma chain)
    scale = np.array([[1.0, 1.0, 2.0, 2.0], [0.5, 1.0, 2.0, 1.0]])
    stats = LocalSGD(mu=2.0).weight_stats(TAU, np.full(20, 0.1), scale)
    np.testing.assert_allclose(stats.l1, cf.prox_l1(TAU, 0.1 * scale, 2.0), rtol=1e-12)


def test_decayed_lr_and_combined_recurrence():
    gamma = 0.9
    solver = LocalSGD(lr_decay=gamma)
    lrs = solver.step_lrs(np.full(20, 0.1))
    np.testing.assert_allclose(solver.weight_stats(TAU, lrs).l1, cf.decay_l1(TAU, gamma), rtol=1e-12)
    # momentum + prox: a_j = sum over later steps of the momentum-filtered, prox-damped impulse response
    rho, lr, mu, tau = 0.5, 0.1, 1.0, 6
    both = LocalSGD(momentum=rho, mu=mu).weight_stats(np.array([[tau]]), np.full(tau, lr))
    # explicit recurrence on a scalar parameter: gradient impulse at step j, prox pulls towards w0 = 0
    a = []
    for j in range(tau):
        w, buf = 0.0, 0.0
        for t in range(tau):
            g = (1.0 if t == j else 0.0) + mu * w
            buf = rho * buf + g
            w -= lr * buf
        a.append(-w / lr)
    assert both.l1[0, 0] == pytest.approx(sum(abs(v) for v in a), rel=1e-12)


def test_scaffold_control_variate_update_is_option_ii():
    solver = ScaffoldSGD()
    w0 = torch.tensor([[1.0, 2.0], [0.0, 0.0]], dtype=torch.float64)
    c = torch.tensor([[0.5, -0.5], [1.0, 1.0]], dtype=torch.float64)
    saved = [{"control": torch.tensor([0.25, 0.0], dtype=torch.float64)}, {}]
    state = solver.init_state(w0, {"control": c}, saved)
    torch.testing.assert_close(state["correction"], c - torch.tensor([[0.25, 0.0], [0.0, 0.0]], dtype=torch.float64))
    w = w0.clone()
    g = torch.tensor([[1.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    lr = torch.tensor([[0.1], [0.1]], dtype=torch.float64)
    for _ in range(3):
        solver.update(w, g, lr, state)
    torch.testing.assert_close(w, w0 - 0.3 * (g + state["correction"]))  # g + c - c_i at every step
    p = torch.tensor([0.1, 0.6], dtype=torch.float64)  # the clients' objective weights p_k
    new, extras = solver.finish(w0, w, torch.tensor([0.3, 0.3], dtype=torch.float64), state, p)
    # c_i+ = c_i - c + (w0 - w) / (K lr) = g for a constant gradient
    torch.testing.assert_close(new["control"], g)
    torch.testing.assert_close(extras["control"], (g - state["c_i"]) * p[:, None])  # c gains p_k (c_k+ - c_k)
    assert solver.comm_factor == 2
