"""Local solvers: the update each client applies at every local step, vectorized over clients.

A solver is linear in the stochastic gradients, so its delta is
Delta_k = -eta G_k a_k for a weighting vector a_k (Wang et al.). `weight_stats`
finds a_k by running the solver's own `update` on unit gradients, so any mix of
momentum, proximal term, weight decay and lr decay gets the right ||a_k||_1.
"""

from __future__ import annotations

import numpy as np
import torch

from fedharness.contracts import (ClientSlot, ClientState, ControlVariate, LocalSolver, MimeContext, ServerContext,
                                  SolverState, WeightStats)
from fedharness.registry.groups import part, part_names
from fedharness.keys import Key, boolean, choice, number

KEYS: dict[str, Key] = {
    "solver": choice("local solver", part_names("solver")),
    "momentum": number("client momentum (buffer reset each round)", lo=0, hi=1, hi_open=True, batchable=True),
    "nesterov": boolean("Nesterov client momentum"),
    "mu": number("proximal term mu/2 ||w - w_r||^2 (FedProx)", lo=0, batchable=True),
    "weight_decay": number("client weight decay", lo=0),
    "lr_decay": number("exponential decay of the local lr within a round", lo=0, hi=1, lo_open=True,
                       batchable=True),
    "feddyn_alpha": number("FedDyn's alpha: client k minimizes N p_k f_k - <g_k, w> + alpha/2 ||w - w_r||^2 "
                           "(solver, aggregator, server_optimizer feddyn)", lo=0, lo_open=True),
    "mime_momentum": number("solver=mime/mimelite: beta of the server momentum the clients hold fixed", lo=0, hi=1,
                            hi_open=True),
}


# Keys a batch of slots may set per copy: sent per replica in the server context, [R, 1] float64; the batch's
# solver is built with each key's largest value, so its branches run for every slot (a value 0 changes no bits).
PER_COPY = ("mu", "momentum")


@part("solver", "sgd")
class LocalSGD(LocalSolver):
    """SGD with optional momentum (buffer reset each round), Nesterov, proximal mu, weight decay, lr decay."""

    def __init__(self, momentum: float = 0.0, nesterov: bool = False, mu: float = 0.0,
                 weight_decay: float = 0.0, lr_decay: float = 1.0):
        self.momentum, self.nesterov, self.mu = momentum, nesterov, mu
        self.weight_decay, self.lr_decay = weight_decay, lr_decay

    @property
    def is_plain_sgd(self) -> bool:
        return not (self.momentum or self.mu or self.weight_decay or self.lr_decay != 1.0)

    @property
    def rows_of_step_sizes(self) -> bool:
        """Step sizes [R, T] (each row its own) are taken where the weights are their prefix sums: plain SGD, with
        LocalSGD's own step_lrs and weight_stats (a subclass that overrides either gets the per-slot calls, which
        hand it [T] as before; it may override this property where its methods take [R, T] too)."""
        own = type(self).step_lrs is LocalSGD.step_lrs and type(self).weight_stats is LocalSGD.weight_stats
        return own and self.is_plain_sgd

    def step_lrs(self, base_lrs: np.ndarray) -> np.ndarray:
        """The schedule's step sizes times the solver's own exponential decay within the round ([T] or [R, T])."""
        return base_lrs * self.lr_decay ** np.arange(np.shape(base_lrs)[-1])

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        """Per-round state of M client copies; `server_ctx` and `saved` client state feed stateful solvers.

        Every tensor in it has the M copies on its first axis: the executor trains the clients still
        running as a prefix of the batch and hands `update` the state sliced to that prefix."""
        state: SolverState = {"w0": w0, "buf": torch.zeros_like(w0) if self.momentum else None}
        for name in PER_COPY:  # a batch of slots sends each copy's own value (harness/core/slots.py)
            if server_ctx and name in server_ctx:
                state[name] = server_ctx[name].to(w0.dtype)
        return state

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        """One local step in place for the M copies w [M, dim] (a prefix of the round's batch), lr [M, 1]."""
        if self.weight_decay:
            g = g + self.weight_decay * w
        if self.mu:
            g = g + state.get("mu", self.mu) * (w - state["w0"])
        if self.momentum:
            momentum = state.get("momentum", self.momentum)
            buf = state["buf"]
            buf.mul_(momentum).add_(g)
            g = g + momentum * buf if self.nesterov else buf
        return w.addcmul_(g, lr, value=-1.0)

    def weight_stats(self, tau: np.ndarray, step_lrs: np.ndarray, lr_scale: np.ndarray | None = None) -> WeightStats:
        """||a||_1, ||a||_2^2, a_last for each entry of tau, in units of that client's first step size.

        The recurrence runs at each client's actual step sizes (lr_scale * step_lrs), because the
        proximal term and weight decay shrink the weights by (1 - lr mu) per step; the result is
        divided by the client's first step size, so a = [1, ..., 1] for plain SGD.
        """
        scale = np.ones(tau.shape) if lr_scale is None else np.broadcast_to(lr_scale, tau.shape)
        if self.is_plain_sgd and np.ndim(step_lrs) == 2:  # each row its own step sizes [R, T] (rows_of_step_sizes)
            return _plain_row_stats(tau, np.asarray(step_lrs, dtype=np.float64), scale)
        if self.is_plain_sgd:  # a_t = eta_t / eta_0: the prefix sums of the round's relative step sizes
            ratio = np.asarray(step_lrs, dtype=np.float64) / step_lrs[0]
            if (ratio == 1.0).all():  # constant within the round: a = [1, ..., 1]
                return WeightStats(tau.astype(np.float64), tau.astype(np.float64), np.ones(tau.shape), scale)
            l1, l2sq = np.cumsum(ratio), np.cumsum(ratio * ratio)
            return WeightStats(l1[tau - 1], l2sq[tau - 1], ratio[tau - 1], scale)
        pairs = np.stack([tau.reshape(-1).astype(np.float64), scale.reshape(-1)], 1)
        uniq, inverse = np.unique(pairs, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        steps = uniq[:, 0].astype(np.int64)
        T = int(steps.max())
        w = torch.zeros(len(uniq), T, dtype=torch.float64)
        state = self.init_state(torch.zeros_like(w))  # w0 = 0: a separate tensor, so the prox term sees w - w0
        client_lr = torch.as_tensor(uniq[:, 1:2] * step_lrs[:T][None, :], dtype=torch.float64)  # [U, T]
        active = torch.as_tensor(steps)[:, None]
        for t in range(T):
            unit = torch.zeros_like(w)
            unit[:, t] = 1.0
            self.update(w, unit, client_lr[:, t:t + 1] * (t < active), state)
        a = -w.numpy() / client_lr[:, :1].numpy()
        l1, l2sq = np.abs(a).sum(1), (a * a).sum(1)
        last = a[np.arange(len(uniq)), steps - 1]
        shape = tau.shape
        return WeightStats(l1[inverse].reshape(shape), l2sq[inverse].reshape(shape), last[inverse].reshape(shape),
                           scale)


def _plain_row_stats(tau: np.ndarray, step_lrs: np.ndarray, scale: np.ndarray) -> WeightStats:
    """Plain SGD's statistics with each row's own step sizes [R, T]: a_t = eta_t / eta_0 of the row, the prefix sums
    taken along the row as the [T] case takes them (so equal bits; with constant steps exact integers, the values
    the [T] case returns without summing)."""
    ratio = step_lrs / step_lrs[:, :1]
    l1, l2sq = np.cumsum(ratio, axis=1), np.cumsum(ratio * ratio, axis=1)
    last = tau - 1
    return WeightStats(np.take_along_axis(l1, last, axis=1), np.take_along_axis(l2sq, last, axis=1),
                       np.take_along_axis(ratio, last, axis=1), scale)


def zero_control(w0: torch.Tensor, server_ctx) -> torch.Tensor:
    """A client's vector before its first round (SCAFFOLD's c_i, FedDyn's g_k): 0 [m, dim] float64."""
    return torch.zeros(w0.shape, dtype=torch.float64, device=w0.device)


@part("solver", "scaffold")
class ScaffoldSGD(LocalSGD):
    """SCAFFOLD, option II (Karimireddy et al.; Wang et al.'s cross-client VR correction).

    Each local step uses g + c - c_i. After tau steps the client sets
    c_i+ = c_i - c + (w0 - w) / (sum of its step sizes) and the server adds
    sum over distinct sampled clients of p_i (c_i+ - c_i) to c, so c = sum_i p_i c_i at all times
    (whatever the sampler). At a fixed point c_i = grad F_i(x), so c = 0 is grad F(x) = 0 for the
    weighted objective F = sum p_i F_i; the unweighted 1/N of Karimireddy et al. would instead
    stop at the optimum of (1/N) sum F_i when the p_i differ. Control variates start at zero;
    the clients' c_i live in their shard (keyed by replica and client), c in the run state.
    Uploads and downloads carry a control variate besides the model: twice the bytes.
    """

    comm_factor = 2

    def client_slots(self, problem) -> tuple[ClientSlot, ...]:
        """Each client's c_i: float64 [dim], zero at its first round (contracts.KeepsClientState)."""
        return (ClientSlot("control", (problem.dim,), torch.float64, zero_control),)

    def init_server_ctx(self, x: torch.Tensor) -> ControlVariate:
        return {"control": torch.zeros(x.shape, dtype=torch.float64, device=x.device)}

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        state = super().init_state(w0, server_ctx, saved)
        zeros = torch.zeros(w0.shape, dtype=torch.float64, device=w0.device)
        c = server_ctx["control"] if server_ctx else zeros
        c_i = zeros if not saved else torch.stack(
            [s["control"].to(w0.device) if "control" in s else zeros[0] for s in saved])
        state.update(c=c, c_i=c_i, correction=(c - c_i).to(w0.dtype))
        return state

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        return super().update(w, g + state["correction"], lr, state)

    def finish(self, w0: torch.Tensor, w: torch.Tensor, lr_sum: torch.Tensor, state: SolverState,
               p: torch.Tensor) -> tuple[ControlVariate, ControlVariate]:
        """The client's new c_i, and p_i (c_i+ - c_i) to add into the server's c (`p` [M]: each client's p_k)."""
        c_new = state["c_i"] - state["c"] + (w0 - w).double() / lr_sum[:, None]
        return {"control": c_new}, {"control": (c_new - state["c_i"]) * p[:, None]}

    def update_server_ctx(self, ctx: ServerContext, extras: dict[str, torch.Tensor]) -> ControlVariate:
        return {**ctx, "control": ctx["control"] + extras["control"]}


@part("solver", "feddyn")
class FedDynSGD(LocalSGD):
    """FedDyn's client (Acar et al. 2021, Algorithm 1): the minimizer of the dynamically regularized objective

        L_k(w) - <g_k, w> + alpha/2 ||w - w_r||^2,   L_k = N p_k f_k,

    found by local SGD on that objective divided by N p_k, f_k(w) - (<g_k, w> - alpha/2 ||w - w_r||^2) / (N p_k):
    the same minimizer, with steps at the scale of f_k's own gradients (the authors' code divides alpha by the
    client's N p_k so: alpha_coef / weight_list). After the round the client sets g_k+ = g_k - alpha (w_k - w_r),
    the paper's recursion: with the local problem solved, g_k+ = grad L_k(w_k) (kept, never recomputed). g_k
    starts at 0 and lives in the client's shard (slot feddyn_grad); a client that does not take part keeps its
    own. Scaling f_k by N p_k (1 with equal weights) makes the fixed point argmin (1/N) sum_k L_k, the optimum of
    sum_k p_k f_k. The shard gives each copy's p_k (SolverState p); sizing a step or reading the weights: 1.
    """

    def __init__(self, feddyn_alpha: float, num_clients: int, momentum: float = 0.0, nesterov: bool = False,
                 mu: float = 0.0, weight_decay: float = 0.0, lr_decay: float = 1.0):
        super().__init__(momentum, nesterov, mu, weight_decay, lr_decay)
        self.alpha, self.num_clients = float(feddyn_alpha), num_clients

    @property
    def is_plain_sgd(self) -> bool:
        return False  # the alpha term shrinks each gradient's weight in the delta, as a proximal term does

    def client_slots(self, problem) -> tuple[ClientSlot, ...]:
        """Each client's g_k: float64 [dim], zero at its first round (contracts.KeepsClientState)."""
        return (ClientSlot("feddyn_grad", (problem.dim,), torch.float64, zero_control),)

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        state = super().init_state(w0, server_ctx, saved)
        zeros = torch.zeros(w0.shape, dtype=torch.float64, device=w0.device)
        state["g_k"] = zeros if not saved else torch.stack([s["feddyn_grad"].to(w0.device) for s in saved])
        state["linear"] = state["g_k"].to(w0.dtype)
        return state

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        pull = self.alpha * (w - state["w0"]) - state["linear"]
        if "p" in state:
            pull = pull / (self.num_clients * state["p"]).to(w.dtype)[:, None]
        return super().update(w, g + pull, lr, state)

    def finish(self, w0: torch.Tensor, w: torch.Tensor, lr_sum: torch.Tensor, state: SolverState,
               p: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The client's new g_k (nothing summed: the server's h follows from the models, FedDynServer)."""
        return {"feddyn_grad": state["g_k"] - self.alpha * (w - w0).double()}, {}


@part("solver", "mimelite", control=False)
@part("solver", "mime", control=True)
class MimeSGD(LocalSGD):
    """Mime and MimeLite (Karimireddy et al. 2020, Algorithm 1) with SGD + momentum as the base algorithm, in the
    paper's convention U(g, m) = (1 - beta) g + beta m (the step), V(g, m) = (1 - beta) g + beta m (the state).

    The server's momentum m is sent to the clients and held fixed during their local steps:
        y <- y - lr ((1 - beta) g + beta m),
    with g = grad f_k(y; z) - grad f_k(x; z) + c for Mime (c = sum_k c_k grad F_k(x) over the round's clients,
    computed in an exchange of its own before the local steps), g = grad f_k(y; z) for MimeLite. Every client also
    sends its full-batch gradient grad F_k(x) (Mime: in that first exchange; MimeLite: with its update), and the
    server sets m <- (1 - beta) sum_k c_k grad F_k(x) + beta m; the model takes the aggregate as FedAvg does.
    Bytes: MimeLite x and m down, Delta_k and grad F_k(x) up; Mime also c down. Gradients: Mime's steps take two
    minibatch gradients each; both add one full pass over each client's samples.
    """

    def __init__(self, mime_momentum: float = 0.9, control: bool = True):
        super().__init__()
        self.beta, self.control = float(mime_momentum), control
        self.comm_factor, self.extra_down = 2, int(control)
        self.round_gradient = "before" if control else "after"
        self.grads_per_step = 1 + int(control)  # Mime's steps also take the minibatch's gradient at x

    def init_server_ctx(self, x: torch.Tensor) -> MimeContext:
        zeros = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        return {"momentum": zeros, "grad": zeros.clone()}

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        state = super().init_state(w0, server_ctx, saved)
        ctx = server_ctx or self.init_server_ctx(w0)
        state["held"] = (self.beta * ctx["momentum"]).to(w0.dtype)
        if self.control:
            state["c"] = ctx["grad"].to(w0.dtype)
        return state

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        if self.control:
            g = g - state["grad_at"](state["w0"]) + state["c"]  # the same minibatch at x
        step = torch.add(state["held"], g, alpha=1.0 - self.beta)
        return w.addcmul_(step, lr, value=-1.0)

    def update_server_ctx(self, ctx: ServerContext, extras: dict[str, torch.Tensor]) -> MimeContext:
        grad = extras["grad"]
        return {"momentum": (1.0 - self.beta) * grad + self.beta * ctx["momentum"], "grad": grad}
