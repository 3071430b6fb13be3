"""Server optimizers: x_{r+1} from x_r and the aggregated delta Delta (the pseudo-gradient is u = -Delta).

`step(x, delta, state, lr)` gets the round's client step size per replica (`lr`, [R], the
first local step's size; None means 1) for the optimizers whose convention divides by it.
State is a mapping of named float64 [R, dim] tensors (harness/contracts.py) kept in RunState.server_state.
"""

from __future__ import annotations

import numpy as np
import torch

from fedharness.contracts import AdamState, FedDynState, FedExPState, MomentumState, ServerOptimizer, ServerState
from fedharness.registry.groups import part, part_names
from fedharness.keys import Key, choice, number

_RATE = {"lo": 0, "hi": 1, "hi_open": True}
KEYS: dict[str, Key] = {
    "server_lr": number("eta_g; 1 is plain FedAvg", lo=0, lo_open=True, batchable=True),
    "server_optimizer": choice("sgd | momentum | nesterov | adam | yogi | fedexp | feddyn", part_names("server_optimizer")),
    "server_momentum": number("server_optimizer=momentum/nesterov: beta", **_RATE, batchable=True),
    "server_beta1": number("server_optimizer=adam/yogi: beta1", **_RATE),
    "server_beta2": number("server_optimizer=adam/yogi: beta2", **_RATE),
    "server_eps": number("server_optimizer=adam/yogi: tau, the adaptivity", lo=0, lo_open=True),
    "fedexp_eps": number("server_optimizer=fedexp: epsilon of eta_g's denominator", lo=0),
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


@part("server_optimizer", "fedexp")
class FedExP(ServerOptimizer):
    """FedExP (Jhunjhunwala, Wang, Joshi, ICLR 2023, Algorithm 1): an extrapolated server step

        eta_g = max(1, sum_k c_k ||Delta_k||^2 / (2 (||Delta||^2 + eps))),   x <- x + eta_g Delta,

    with Delta = sum_k c_k Delta_k the aggregate of the updates Delta_k (the aggregator's coefficients c_k).
    With c_k = 1/M (M clients of equal weight sampled uniformly) this is the paper's
    sum_i ||Delta_i||^2 / (2 M (||Delta_bar||^2 + eps)); with c_k = p_k (full participation) it is the weighted
    form of the authors' code (github.com/Divyansh03/FedExP, main.py, which puts M eps where the paper has eps).
    eps: 1e-3 in the paper's CIFAR-10/100 and CINIC-10 runs, 0.1 for EMNIST, 0 in its linear regression
    (the authors' code also decays eps by the square of its client lr decay; not done here). The iterates
    oscillate: the paper reports the average of the last two (series last_two, on in conf/algorithm/fedexp.yaml).
    A replica nobody returned to has Delta = 0 and takes eta_g = 1.
    """

    reads_sq_norms = True
    server_lr = None  # eta_g adapts: each row's own is recorded (step_sizes)

    def __init__(self, fedexp_eps: float = 1e-3):
        self.eps = float(fedexp_eps)

    def init_state(self, x: torch.Tensor) -> FedExPState:
        return {"eta": torch.full((x.shape[0], 1), float("nan"), dtype=torch.float64, device=x.device)}

    def step(self, x: torch.Tensor, delta: torch.Tensor, state: FedExPState, lr=None,
             sq_norms: np.ndarray | None = None) -> torch.Tensor:
        d = delta.double()
        spread = torch.as_tensor(np.asarray(sq_norms, dtype=np.float64), device=d.device)
        eta = torch.clamp(spread / (2.0 * ((d * d).sum(1) + self.eps)), min=1.0)
        eta = torch.where(torch.isnan(eta), torch.ones_like(eta), eta)  # 0 / 0: nobody returned, eps = 0
        state["eta"].copy_(eta[:, None])
        return (x.double() + eta[:, None] * d).to(x.dtype)

    def step_sizes(self, state: FedExPState) -> np.ndarray:
        return state["eta"][:, 0].cpu().numpy()
