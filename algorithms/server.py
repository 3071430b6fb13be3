"""Server optimizers: x_{r+1} from x_r and the aggregated delta Delta (the pseudo-gradient is u = -Delta).

`step(x, delta, state, lr)` gets the round's client step size per replica (`lr`, [R], the
first local step's size; None means 1) for the optimizers whose convention divides by it.
State is a mapping of named float64 [R, dim] tensors (harness/contracts.py) kept in RunState.server_state.
"""

from __future__ import annotations

import numpy as np
import torch

from fedharness.contracts import AdamState, FedDynState, MomentumState, ServerOptimizer, ServerState
from fedharness.registry.groups import part, part_names
from fedharness.keys import Key, choice, number

_RATE = {"lo": 0, "hi": 1, "hi_open": True}
KEYS: dict[str, Key] = {
    "server_lr": number("eta_g; 1 is plain FedAvg", lo=0, lo_open=True, batchable=True),
    "server_optimizer": choice("sgd | momentum | nesterov | adam | yogi", part_names("server_optimizer")),
    "server_momentum": number("server_optimizer=momentum/nesterov: beta", **_RATE, batchable=True),
    "server_beta1": number("server_optimizer=adam/yogi: beta1", **_RATE),
    "server_beta2": number("server_optimizer=adam/yogi: beta2", **_RATE),
    "server_eps": number("server_optimizer=adam/yogi: tau, the adaptivity", lo=0, lo_open=True),
}


def _client_lr(lr, x: torch.Tensor) -> torch.Tensor | float:
    if lr is None:
        return 1.0
    return torch.as_tensor(np.asarray(lr, dtype=np.float64), device=x.device).reshape(-1, 1)


@part("server_optimizer", "sgd")
class ServerSGD(ServerOptimizer):
    """x_{r+1} = x_r + eta_g * Delta: eta_g = 1 is plain FedAvg (Yang et al.'s two-sided step sizes)."""

    def __init__(self, server_lr: float = 1.0):
        self.server_lr = float(server_lr)

    def step(self, x: torch.Tensor, delta: torch.Tensor, state: ServerState, lr=None) -> torch.Tensor:
        return (x.double() + self.server_lr * delta).to(x.dtype)


@part("server_optimizer", "nesterov", nesterov=True)
@part("server_optimizer", "momentum", nesterov=False)
class ServerMomentum(ServerSGD):
    """Server (slow) momentum in FedNova's / SlowMo's convention, optionally Nesterov.

    u = -Delta, eta = the round's client lr:
        buf <- beta buf + u / eta
        x   <- x - eta_g eta buf                       (heavy ball)
        x   <- x - eta_g eta (u / eta + beta buf)      (Nesterov, buf already updated)
    With a constant client lr this is heavy ball on the pseudo-gradients; dividing by eta
    keeps the buffer in gradient units when the client lr is decayed.
    """

    def __init__(self, server_lr: float, server_momentum: float, nesterov: bool = False):
        super().__init__(server_lr)
        self.beta = float(server_momentum)
        self.nesterov = nesterov

    def init_state(self, x: torch.Tensor) -> MomentumState:
        return {"buf": torch.zeros(x.shape, dtype=torch.float64, device=x.device)}

    def step(self, x: torch.Tensor, delta: torch.Tensor, state: MomentumState, lr=None) -> torch.Tensor:
        eta = _client_lr(lr, x)
        grad = -delta / eta
        buf = state["buf"].mul_(self.beta).add_(grad)
        direction = grad + self.beta * buf if self.nesterov else buf
        return (x.double() - self.server_lr * eta * direction).to(x.dtype)


@part("server_optimizer", "yogi", yogi=True)
@part("server_optimizer", "adam", yogi=False)
class ServerAdam(ServerSGD):
    """FedAdam / FedYogi (Reddi et al., Adaptive Federated Optimization, Algorithm 2), no bias correction.

        m <- b1 m + (1 - b1) Delta
        v <- b2 v + (1 - b2) Delta^2                           (Adam)
        v <- v - (1 - b2) Delta^2 sign(v - Delta^2)            (Yogi)
        x <- x + eta_g m / (sqrt(v) + tau)
    with m_{-1} = 0 and v_{-1} = tau^2 (the paper asks v_{-1} >= tau^2).
    """

    def __init__(self, server_lr: float, server_beta1: float, server_beta2: float, server_eps: float,
                 yogi: bool = False):
        super().__init__(server_lr)
        self.beta1, self.beta2, self.eps, self.yogi = float(server_beta1), float(server_beta2), float(server_eps), yogi

    def init_state(self, x: torch.Tensor) -> AdamState:
        zeros = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        return {"m": zeros, "v": torch.full_like(zeros, self.eps ** 2)}

    def step(self, x: torch.Tensor, delta: torch.Tensor, state: AdamState, lr=None) -> torch.Tensor:
        m, v = state["m"], state["v"]
        sq = delta * delta
        m.mul_(self.beta1).add_(delta, alpha=1.0 - self.beta1)
        if self.yogi:
            v.sub_((1.0 - self.beta2) * sq * torch.sign(v - sq))
        else:
            v.mul_(self.beta2).add_(sq, alpha=1.0 - self.beta2)
        return (x.double() + self.server_lr * m / (v.sqrt() + self.eps)).to(x.dtype)


@part("server_optimizer", "feddyn")
class FedDynServer(ServerOptimizer):
    """FedDyn's server (Acar et al. 2021, Algorithm 1), from the plain mean Delta of the |P| returned clients'
    updates (aggregator feddyn):

        h <- h - alpha (1/N) sum_{k in P} Delta_k = h - alpha (|P| / N) Delta
        x <- x + Delta - h / alpha                  (the mean of the clients' models, less h / alpha)

    h starts at 0, so it stays the mean (1/N) sum_k g_k of every client's g_k (FedDynSGD); the N of 1/N is every
    client, not only those of the round. |P| is the sampler's: N (full) or clients_per_round (yang_s2); the
    schema refuses samplers, dropout and systems settings that would change it from round to round.
    """

    server_lr = None  # no server step size in FedDyn

    def __init__(self, feddyn_alpha: float, num_clients: int, sampler: str, clients_per_round: int):
        self.alpha = float(feddyn_alpha)
        self.share = 1.0 if sampler == "full" else clients_per_round / num_clients  # |P| / N

    def init_state(self, x: torch.Tensor) -> FedDynState:
        return {"h": torch.zeros(x.shape, dtype=torch.float64, device=x.device)}

    def step(self, x: torch.Tensor, delta: torch.Tensor, state: FedDynState, lr=None) -> torch.Tensor:
        h = state["h"].sub_(self.alpha * self.share * delta)
        return (x.double() + delta - h / self.alpha).to(x.dtype)
