"""Server optimizers against hand-computed updates (two steps each), and the client lr the engine passes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.algorithms import server
from fedharness.core.engine import Engine
from fedharness.errors import ConfigError
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

X0 = torch.tensor([[1.0, -2.0]], dtype=torch.float64)


def _two_steps(opt, deltas, lrs) -> list[torch.Tensor]:
    x, state, out = X0.clone(), opt.init_state(X0), []
    for d, lr in zip(deltas, lrs):
        x = opt.step(x, torch.tensor([d], dtype=torch.float64), state, None if lr is None else np.array([lr]))
        out.append(x)
    for v in state.values():
        assert v.dtype == torch.float64
    return out


def test_sgd_with_server_lr():
    x1, x2 = _two_steps(server.ServerSGD(0.5), [[0.4, 0.2], [-0.2, 1.0]], [0.1, 0.1])
    torch.testing.assert_close(x1, torch.tensor([[1.2, -1.9]], dtype=torch.float64))
    torch.testing.assert_close(x2, torch.tensor([[1.1, -1.4]], dtype=torch.float64))


# u = -Delta; eta_1 = 0.1, eta_2 = 0.05 (a decayed client lr: the convention divides by it)
DELTAS, LRS = [[0.5, 0.1], [-0.2, 0.4]], [0.1, 0.05]


def test_momentum_fednova_convention():
    """buf1 = u1/eta1 = [-5, -1]; x1 = x0 - 0.7*0.1*buf1 = [1.35, -1.93];
    buf2 = 0.9 buf1 + u2/eta2 = [-0.5, -8.9]; x2 = x1 - 0.7*0.05*buf2 = [1.3675, -1.6185]."""
    x1, x2 = _two_steps(server.ServerMomentum(0.7, 0.9), DELTAS, LRS)
    torch.testing.assert_close(x1, torch.tensor([[1.35, -1.93]], dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(x2, torch.tensor([[1.3675, -1.6185]], dtype=torch.float64), rtol=0, atol=1e-14)


def test_nesterov():
    """step 1: dir = u1/eta1 + 0.9 buf1 = [-9.5, -1.9]; x1 = x0 - 0.07 dir = [1.665, -1.867];
    step 2: dir = u2/eta2 + 0.9 buf2 = [4, -8] + 0.9 [-0.5, -8.9] = [3.55, -16.01]; x2 = x1 - 0.035 dir."""
    x1, x2 = _two_steps(server.ServerMomentum(0.7, 0.9, nesterov=True), DELTAS, LRS)
    torch.testing.assert_close(x1, torch.tensor([[1.665, -1.867]], dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(x2, torch.tensor([[1.54075, -1.30665]], dtype=torch.float64), rtol=0, atol=1e-14)


def test_momentum_without_lr_is_heavy_ball_on_deltas_and_beta_zero_is_sgd():
    x1, x2 = _two_steps(server.ServerMomentum(1.0, 0.5), DELTAS, [None, None])
    torch.testing.assert_close(x2, X0 + torch.tensor([[0.5 * 1.5 - 0.2, 0.1 * 1.5 + 0.4]], dtype=torch.float64))
    plain = _two_steps(server.ServerSGD(0.7), DELTAS, LRS)
    zero = _two_steps(server.ServerMomentum(0.7, 0.0), DELTAS, LRS)
    torch.testing.assert_close(zero[1], plain[1], rtol=0, atol=1e-14)


# Adam / Yogi: b1 = 0.9, b2 = 0.99, tau = 1e-3, eta = 0.7, v_{-1} = tau^2. The second delta is small, so
# Yogi's v grows in one coordinate (v < Delta^2) and shrinks additively in the other (v > Delta^2).
ADAM_DELTAS = [[0.5, 0.1], [-0.02, 0.04]]


def test_adam():
    x1, x2 = _two_steps(server.ServerAdam(0.7, 0.9, 0.99, 1e-3), ADAM_DELTAS, [0.1, 0.1])
    torch.testing.assert_close(x1, torch.tensor([[1.686141330846639, -1.3664801817034458]], dtype=torch.float64),
                               rtol=1e-13, atol=0)
    torch.testing.assert_close(x2, torch.tensor([[2.2786680306702705, -0.5932890622222038]], dtype=torch.float64),
                               rtol=1e-13, atol=0)


def test_yogi():
    opt = server.ServerAdam(0.7, 0.9, 0.99, 1e-3, yogi=True)
    x1, x2 = _two_steps(opt, ADAM_DELTAS, [0.1, 0.1])
    torch.testing.assert_close(x1, torch.tensor([[1.6861399860027988, -1.3665087065215382]], dtype=torch.float64),
                               rtol=1e-13, atol=0)
    torch.testing.assert_close(x2, torch.tensor([[2.2766835472757703, -0.596409139106307]], dtype=torch.float64),
                               rtol=1e-13, atol=0)


class _Spy(server.ServerMomentum):
    def __init__(self):
        super().__init__(1.0, 0.5)
        self.seen = []

    def step(self, x, delta, state, lr=None):
        self.seen.append(np.array(lr))
        return super().step(x, delta, state, lr)


def test_engine_passes_the_round_client_lr(run_config):
    cfg = run_config("dataset=quadratic", "algorithm.lr_schedule=inverse_round", "algorithm.client_lr=0.3",
                     "algorithm.server_optimizer=momentum", "replicas=2")
    problem, algorithm, _ = prepare(cfg)
    algorithm.server = spy = _Spy()
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=3, seed=0, replicas=2,
                    eval_every=3)
    state = engine.initial_state()
    assert state.server_state["buf"].shape == (2, problem.dim)
    for _ in range(3):
        state = engine.step(state)
    np.testing.assert_allclose(np.stack(spy.seen), [[0.3, 0.3], [0.15, 0.15], [0.1, 0.1]], rtol=1e-15)


@pytest.mark.parametrize("optimizer,override,key", [
    ("momentum", "algorithm.server_momentum=1.0", "algorithm.server_momentum"),
    ("nesterov", "algorithm.server_momentum=-0.1", "algorithm.server_momentum"),
    ("momentum", "algorithm.server_momentum=heavy", "algorithm.server_momentum"),
    ("adam", "algorithm.server_beta1=1.0", "algorithm.server_beta1"),
    ("yogi", "algorithm.server_beta2=-0.5", "algorithm.server_beta2"),
    ("adam", "algorithm.server_eps=0", "algorithm.server_eps"),
    ("yogi", "algorithm.server_eps=null", "algorithm.server_eps"),
    ("adam", "algorithm.server_lr=0", "algorithm.server_lr"),
    ("sgd", "algorithm.server_lr=-1", "algorithm.server_lr"),
    ("lamb", "algorithm.server_lr=1", "algorithm.server_optimizer"),
])
def test_bad_server_values_name_the_key(optimizer, override, key, run_config):
    with pytest.raises(ConfigError) as err:
        prepare(run_config("dataset=quadratic", f"algorithm.server_optimizer={optimizer}", override))
    assert err.value.key == key
