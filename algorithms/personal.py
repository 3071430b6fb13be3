"""Solvers whose clients each keep a model of their own (contracts.PersonalSolver): Ditto, FedRep, FedBABU.

Each is a LocalSolver, so it trains batched over (replica, client) copies in the shards like any other, keeps its
per-client part in the client store (a ClientSlot: checkpointed, restored, on any shard count) and is scored under
eval.personal=personal by harness/core/personal.py. FedRep and FedBABU need a model that declares its head
(contracts.Model.head: built-in nets name their last layer; a user's model passes model.head).
"""

from __future__ import annotations

import numpy as np
import torch

from fedharness.algorithms.solvers import LocalSGD
from fedharness.contracts import ClientSlot, ClientState, Problem, ServerContext, SolverState, WeightStats
from fedharness.errors import ConfigError
from fedharness.keys import Key, number
from fedharness.registry.groups import part

KEYS: dict[str, Key] = {
    "ditto_lambda": number("solver=ditto: the proximal weight lambda of each personal objective "
                           "f_k(v) + lambda/2 ||v - w||^2 (Li et al. 2021)", lo=0),
    "fedrep_head_share": number("solver=fedrep: the share of a client's local steps tau_k, the first "
                                "floor(share tau_k) of a round (at most tau_k - 1), that train its head on the fixed "
                                "body; the rest train the body on the fixed head", lo=0, hi=1, hi_open=True),
}


def model_name(problem: Problem) -> str:
    """The model's name, as the `model` key names it (an analytic problem's: its data set's objective)."""
    return "the data set's own objective" if problem.objective is None else f"model={problem.objective.name}"


def require_head(problem: Problem, solver: str) -> tuple[int, int]:
    """The head's entries [lo, hi) of the flat vector; ConfigError naming the model and the solver without one."""
    head = None if problem.objective is None else problem.objective.head
    if head is None:
        raise ConfigError("algorithm.solver", solver, f"a solver that needs no head: {model_name(problem)} declares "
                          "none (built-in nets name their last layer; a user's model names it in model.head)")
    return int(head[0]), int(head[1])


def refuse_buffers(problem: Problem, solver: str) -> None:
    """ConfigError naming the solver for a model with buffers (BatchNorm statistics): a personal model of the
    solver's would need its own."""
    if problem.objective is not None and problem.objective.buffer_dim:
        raise ConfigError("algorithm.solver", solver, f"a solver other than {solver} with {model_name(problem)}: "
                          "its buffers (BatchNorm statistics) would need a personal copy of their own")


def _global_copy(w0: torch.Tensor, server_ctx) -> torch.Tensor:
    """A personal model before the client's first round: the global model it starts from."""
    return w0.clone()


def stacked_slot(saved: list[ClientState] | None, name: str, start: torch.Tensor) -> torch.Tensor:
    """The copies' kept values of slot `name` [M, ...] (the slot's initial value where first seen), else `start`."""
    if not saved:
        return start.clone()
    return torch.stack([s[name].to(start.device, start.dtype) for s in saved])


@part("solver", "ditto")
class DittoSGD(LocalSGD):
    """Ditto (Li, Hu, Beirami, Smith, ICML 2021, Algorithm 1): the global model w by the run's FedAvg-family local
    steps; in the same round each sampled client also takes its tau steps on its personal model v_k, on the same
    minibatches, for f_k(v) + lambda/2 ||v - w^t||^2 (w^t: the round's global model):
        v_k <- v_k - eta (grad f_k(v_k) + lambda (v_k - w^t)).
    v_k lives in the client's slot `personal` (the global model at its first round); it never leaves the client
    and changes nothing the server sees. Each step takes a second gradient (grad_evals counts both)."""

    personal_slot = "personal"
    grads_per_step = 2  # grad f_k at w and at v_k

    def __init__(self, problem: Problem, ditto_lambda: float = 0.1, momentum: float = 0.0, nesterov: bool = False,
                 mu: float = 0.0, weight_decay: float = 0.0, lr_decay: float = 1.0):
        super().__init__(momentum, nesterov, mu, weight_decay, lr_decay)
        refuse_buffers(problem, "ditto")
        self.lam = float(ditto_lambda)

    def client_slots(self, problem: Problem) -> tuple[ClientSlot, ...]:
        """Each client's v_k [dim] in the model's dtype, the global model at its first round."""
        return (ClientSlot(self.personal_slot, (problem.dim,), problem.dtype, _global_copy),)

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        state = super().init_state(w0, server_ctx, saved)
        state["v"] = stacked_slot(saved, self.personal_slot, w0)
        return state

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        if "grad_at" in state:  # weight_stats' unit steps take none: the delta is the global model's alone
            self.personal_step(state["v"], state["grad_at"](state["v"]), lr, state["w0"])
        return super().update(w, g, lr, state)

    def personal_step(self, v: torch.Tensor, g: torch.Tensor, lr, w: torch.Tensor) -> None:
        v.sub_((g + self.lam * (v - w)) * lr)

    def personal_model(self, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return kept

    def finish(self, w0: torch.Tensor, w: torch.Tensor, lr_sum: torch.Tensor, state: SolverState,
               p: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        kept, extras = super().finish(w0, w, lr_sum, state, p)
        return {**kept, self.personal_slot: state["v"]}, extras


class HeadSolver(LocalSGD):
    """Local SGD on part of the model: `masks` [2, dim] (0: the head's entries, 1: the body's; and the opposite)
    multiply the step sizes, so an entry a phase does not train keeps its bits (w - 0 g). The head never reaches
    the server (private_dim: not counted in the bytes)."""

    def __init__(self, problem: Problem, solver: str, momentum: float, nesterov: bool, mu: float,
                 weight_decay: float, lr_decay: float):
        super().__init__(momentum, nesterov, mu, weight_decay, lr_decay)
        self.lo, self.hi = require_head(problem, solver)
        self.private_dim = self.hi - self.lo
        body = torch.ones(problem.dim, dtype=problem.dtype, device=problem.device)
        body[self.lo:self.hi] = 0
        self.masks = torch.stack([body, 1 - body])  # [body, head]

    def weight_stats(self, tau: np.ndarray, step_lrs: np.ndarray, lr_scale: np.ndarray | None = None) -> WeightStats:
        """Those of local SGD with the same keys (a step's weight in the delta, read on unit gradients; the masks
        fit the model's vectors, not weight_stats' unit ones)."""
        plain = LocalSGD(self.momentum, self.nesterov, self.mu, self.weight_decay, self.lr_decay)
        return plain.weight_stats(tau, step_lrs, lr_scale)

    def train_head(self, v: torch.Tensor, g: torch.Tensor, lr) -> None:
        """One plain SGD step of the head's entries of copies v in place (the body fixed)."""
        v[:, self.lo:self.hi] -= lr * g[:, self.lo:self.hi]


@part("solver", "fedrep")
class FedRepSGD(HeadSolver):
    """FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, Algorithm 1): a shared body and a head per
    client. Each round a sampled client starts from the global body and its own head (slot `personal_head`: the
    global model's head at its first round), trains the head on the fixed body for the first
    h_k = min(floor(fedrep_head_share tau_k), tau_k - 1) of its tau_k local steps, then the body on the fixed head
    for the rest (the authors' code: 9 of 10 local epochs the head, then 1 the body: share 0.9). Only the body is
    sent: the head's entries of the update are 0, so the server's head stays where it started."""

    personal_slot = "personal_head"

    def __init__(self, problem: Problem, fedrep_head_share: float = 0.9, momentum: float = 0.0,
                 nesterov: bool = False, mu: float = 0.0, weight_decay: float = 0.0, lr_decay: float = 1.0):
        super().__init__(problem, "fedrep", momentum, nesterov, mu, weight_decay, lr_decay)
        self.share = float(fedrep_head_share)

    def client_slots(self, problem: Problem) -> tuple[ClientSlot, ...]:
        lo, hi = self.lo, self.hi
        return (ClientSlot(self.personal_slot, (hi - lo,), problem.dtype, lambda w0, ctx: w0[:, lo:hi].clone()),)

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        state = super().init_state(w0, server_ctx, saved)
        start = w0.clone()  # the global body and each client's own head (also the prox term's anchor)
        start[:, self.lo:self.hi] = stacked_slot(saved, self.personal_slot, w0[:, self.lo:self.hi])
        state["w0"] = start
        state["step"] = torch.zeros(len(w0), dtype=torch.int64, device=w0.device)  # each copy's steps so far
        return state

    def head_steps(self, tau: torch.Tensor) -> torch.Tensor:
        """h_k of copies with tau_k local steps: the head's share, leaving the body at least one step."""
        return torch.minimum(torch.floor(self.share * tau.double()).long(), tau - 1)

    def begin(self, w: torch.Tensor, state: SolverState) -> None:
        w[:, self.lo:self.hi] = state["w0"][:, self.lo:self.hi]

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        in_head = (state["step"] < self.head_steps(state["tau"])).long()  # [n]: 1 in the head phase
        state["step"] += 1
        return super().update(w, g, lr * self.masks[in_head].to(w.dtype), state)

    def finish(self, w0: torch.Tensor, w: torch.Tensor, lr_sum: torch.Tensor, state: SolverState,
               p: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The client's new head, kept; the head's entries of w set back to the server's (an update of 0)."""
        head = w[:, self.lo:self.hi].clone()
        w[:, self.lo:self.hi] = w0[:, self.lo:self.hi]
        return {self.personal_slot: head}, {}

    def personal_model(self, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        out = w.clone()
        out[:, self.lo:self.hi] = kept
        return out

    def personal_step(self, v: torch.Tensor, g: torch.Tensor, lr, w: torch.Tensor) -> None:
        self.train_head(v, g, lr)


@part("solver", "fedbabu")
class FedBabuSGD(HeadSolver):
    """FedBABU (Oh, Kim, Yun, ICLR 2022, Algorithm 1): the head stays at its random initialization during training;
    only the body is trained, aggregated and sent. A client's personal model is the global body with the head
    fine-tuned on its own data for eval.finetune_steps steps (the body fixed) when it is evaluated; nothing is kept
    per client."""

    personal_slot = None

    def __init__(self, problem: Problem, momentum: float = 0.0, nesterov: bool = False, mu: float = 0.0,
                 weight_decay: float = 0.0, lr_decay: float = 1.0):
        super().__init__(problem, "fedbabu", momentum, nesterov, mu, weight_decay, lr_decay)

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        return super().update(w, g, lr * self.masks[0].to(w.dtype), state)

    def personal_model(self, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return w  # never asked: no client keeps a slot

    def personal_step(self, v: torch.Tensor, g: torch.Tensor, lr, w: torch.Tensor) -> None:
        self.train_head(v, g, lr)
