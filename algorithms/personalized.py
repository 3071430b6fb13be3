"""Personalization by a Moreau envelope, a meta-learning step and a mixture: pFedMe, Per-FedAvg and APFL as local
solvers, vectorized over client copies like the others (algorithms/solvers.py).

Each local step takes gradients at points other than the copy's w: the shard hands every step the minibatch's
gradient at any points of the copies (SolverState grad_at: one batched call for all copies, not a loop over
clients). The personal models (contracts.PersonalSolver) are kept in the client store's slot `personal`
(harness/core/client_store.py) or formed at evaluation. A step moves w along one direction, so the weighting
vector (Wang et al.) is plain SGD's, a = [1, ..., 1] (LocalSGD's with no momentum or prox term).
"""

from __future__ import annotations

import torch

from fedharness.algorithms.personal import refuse_buffers, stacked_slot
from fedharness.algorithms.solvers import LocalSGD
from fedharness.contracts import ClientSlot, ClientState, Problem, ServerContext, SolverState
from fedharness.keys import Key, boolean, integer, number
from fedharness.registry.groups import part

KEYS: dict[str, Key] = {
    "pfedme_lambda": number("pFedMe's lambda: the personal model minimizes f_k(theta) + lambda/2 ||theta - w||^2 "
                            "(solver pfedme)", lo=0, lo_open=True),
    "pfedme_inner_steps": integer("pFedMe's K: gradient steps on the personal objective per local step", lo=1),
    "pfedme_inner_lr": number("pFedMe's personal learning rate: the step size of those K steps", lo=0, lo_open=True),
    "perfedavg_step": number("Per-FedAvg's alpha: the adaptation step w - alpha grad f_k(w) (solver perfedavg_fo, "
                             "perfedavg_hf)", lo=0, lo_open=True),
    "perfedavg_delta": number("Per-FedAvg HF's delta: H u ~ (grad f_k(w + delta u) - grad f_k(w - delta u)) / "
                              "(2 delta)", lo=0, lo_open=True),
    "apfl_alpha": number("APFL's mixing weight alpha of the personal model, v_bar = alpha v + (1 - alpha) w (solver "
                         "apfl; with apfl_adaptive its initial value)", lo=0, hi=1),
    "apfl_adaptive": boolean("APFL: each client learns its own alpha by gradient steps (the paper's adaptive APFL)"),
}


@part("solver", "pfedme")
class PFedMe(LocalSGD):
    """pFedMe (Dinh, Tran, Nguyen, NeurIPS 2020, Algorithm 1). Each local step solves the personal problem

        theta = argmin f_k(theta; batch) + lambda/2 ||theta - w||^2

    by K gradient steps of size nu from theta = w (the first one's gradient is the step's own: at theta = w the
    proximal term is 0), then moves w towards it, w <- w - eta lambda (w - theta). The server's beta mixing,
    w <- (1 - beta) w + beta mean_k w_k, is server_optimizer sgd with server_lr = beta. The personal model is theta
    of the client's last local step (the paper's code scores persionalized_model_bar), kept in the slot `personal`;
    a client without one (not yet sampled; unseen) takes eval.finetune_steps steps of size nu on its personal
    objective from the global model (contracts.PersonalSolver)."""

    personal_slot = "personal"

    def __init__(self, pfedme_lambda: float = 15.0, pfedme_inner_steps: int = 5, pfedme_inner_lr: float = 0.1):
        super().__init__()
        self.lam, self.inner_steps, self.inner_lr = float(pfedme_lambda), int(pfedme_inner_steps), \
            float(pfedme_inner_lr)
        self.grads_per_step = self.inner_steps

    def client_slots(self, problem) -> tuple[ClientSlot, ...]:
        """Each client's personal model theta [dim] (written after its rounds; none before)."""
        return (ClientSlot(self.personal_slot, (problem.dim,), problem.dtype),)

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        state = super().init_state(w0, server_ctx, saved)
        state["theta"] = w0.clone()  # each copy's latest personal model, written in place by the prefix's steps
        return state

    def personal(self, w: torch.Tensor, g: torch.Tensor, grad_at) -> torch.Tensor:
        """K steps of size nu on f_k(theta) + lambda/2 ||theta - w||^2 from theta = w, whose gradient is g."""
        theta = w - self.inner_lr * g
        for _ in range(self.inner_steps - 1):
            theta = theta - self.inner_lr * (grad_at(theta) + self.lam * (theta - w))
        return theta

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        theta = self.personal(w, g, state["grad_at"])
        state["theta"].copy_(theta)
        return w.addcmul_(self.lam * (w - theta), lr, value=-1.0)

    def finish(self, w0: torch.Tensor, w: torch.Tensor, lr_sum: torch.Tensor, state: SolverState,
               p: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {self.personal_slot: state["theta"]}, {}

    def personal_model(self, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return kept

    def personal_step(self, v: torch.Tensor, g: torch.Tensor, lr: float, w: torch.Tensor) -> None:
        """A step of size nu on f_k(theta) + lambda/2 ||theta - w||^2 (the evaluation's lr is not pFedMe's)."""
        v.sub_(g + self.lam * (v - w), alpha=self.inner_lr)


@part("solver", "perfedavg_hf", hessian=True)
@part("solver", "perfedavg_fo", hessian=False)
class PerFedAvg(LocalSGD):
    """Per-FedAvg (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020): local SGD on f_k(w - alpha grad f_k(w)),

        w <- w - eta (I - alpha H_k(w)) grad f_k(w - alpha grad f_k(w))     (HF; FO drops alpha H_k(w))

    with HF's Hessian-vector product the paper's central difference H_k(w) u ~ (grad f_k(w + delta u) -
    grad f_k(w - delta u)) / (2 delta) (exact where f_k is quadratic, up to rounding; it needs nothing of a model
    but its batched gradient). Every gradient is on the step's minibatch (the paper draws independent batches D,
    D', D''; here they are one). The personal model is one adaptation step w - alpha grad f_k(w) from the global
    model, taken at evaluation on a minibatch of the client's (contracts.PersonalSolver, nothing kept)."""

    personal_slot = None
    personal_steps = 1

    def __init__(self, perfedavg_step: float = 0.001, perfedavg_delta: float = 0.001, hessian: bool = True):
        super().__init__()
        self.alpha, self.delta, self.hessian = float(perfedavg_step), float(perfedavg_delta), hessian
        self.grads_per_step = 4 if hessian else 2

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        grad_at = state["grad_at"]
        d = grad_at(w - self.alpha * g)
        if self.hessian:
            h = self.delta * d
            d = d - self.alpha / (2 * self.delta) * (grad_at(w + h) - grad_at(w - h))
        return w.addcmul_(d, lr, value=-1.0)

    def personal_model(self, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return w  # never asked: no client keeps a personal model

    def personal_step(self, v: torch.Tensor, g: torch.Tensor, lr: float, w: torch.Tensor) -> None:
        v.sub_(g, alpha=self.alpha)


@part("solver", "apfl")
class APFL(LocalSGD):
    """APFL (Deng, Kamani, Mahdavi 2020, Algorithm 1): each client keeps a personal model v_k (w at its first round)
    and trains it with the global one, both from the step's values, on the same minibatch:

        w <- w - eta grad f_k(w)
        v <- v - eta alpha grad f_k(v_bar),          v_bar = alpha v + (1 - alpha) w
        alpha <- clip(alpha - eta <v - w, grad f_k(v_bar)>, 0, 1)       (apfl_adaptive: each client's alpha_k)

    Only w is aggregated. v_k and alpha_k are the client's slot `personal`, [v_k, alpha_k] ([dim + 1], the model's
    dtype). Its personal model is v_bar_k = alpha_k v_k + (1 - alpha_k) w with the global w; a client without one
    (not yet sampled; unseen) starts from v = w, so v_bar = w, and takes eval.finetune_steps of v's step with w
    fixed, v_bar <- v_bar - lr alpha^2 grad f_k(v_bar), at the configured alpha (contracts.PersonalSolver)."""

    personal_slot = "personal"

    def __init__(self, problem: Problem, apfl_alpha: float = 0.25, apfl_adaptive: bool = False):
        super().__init__()
        refuse_buffers(problem, "apfl")  # v_bar would mix the buffers of two rounds' models
        self.alpha, self.adaptive = float(apfl_alpha), apfl_adaptive
        self.grads_per_step = 2

    def client_slots(self, problem) -> tuple[ClientSlot, ...]:
        """[v_k, alpha_k] [dim + 1]: the global model and apfl_alpha at the client's first round."""
        return (ClientSlot(self.personal_slot, (problem.dim + 1,), problem.dtype, self.first_personal),)

    def first_personal(self, w0: torch.Tensor, server_ctx) -> torch.Tensor:
        return torch.cat([w0, torch.full((len(w0), 1), self.alpha, dtype=w0.dtype, device=w0.device)], 1)

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        state = super().init_state(w0, server_ctx, saved)
        kept = stacked_slot(saved, self.personal_slot, self.first_personal(w0, None))
        state["v"], state["alpha"] = kept[:, :-1], kept[:, -1:]  # views of `kept`: the steps update it in place
        state["kept"] = kept
        return state

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        v, alpha = state["v"], state["alpha"]
        gv = state["grad_at"](alpha * v + (1.0 - alpha) * w)
        if self.adaptive:  # from the step's v and w, before either moves
            grad_alpha = ((v - w) * gv).sum(1, keepdim=True)
            new_alpha = (alpha - lr * grad_alpha).clamp_(0.0, 1.0)
        v.addcmul_(alpha * gv, lr, value=-1.0)
        if self.adaptive:
            alpha.copy_(new_alpha)
        return w.addcmul_(g, lr, value=-1.0)

    def finish(self, w0: torch.Tensor, w: torch.Tensor, lr_sum: torch.Tensor, state: SolverState,
               p: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {self.personal_slot: state["kept"]}, {}

    def personal_model(self, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        alpha = kept[:, -1:]
        return alpha * kept[:, :-1] + (1.0 - alpha) * w

    def personal_step(self, v: torch.Tensor, g: torch.Tensor, lr: float, w: torch.Tensor) -> None:
        v.sub_(g, alpha=lr * self.alpha ** 2)
