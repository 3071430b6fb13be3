"""Client learning-rate schedules: the step size of each local step of round r.

Every schedule is a pure function of (round, step), so a resumed run and a fresh one
use the same step sizes. `step_lrs(rnd, steps)` returns the sizes of local steps
0..steps-1 of round `rnd`.
"""

from __future__ import annotations

import numpy as np
import torch

from fedharness.contracts import ExactSolve, Problem, Schedule
from fedharness.registry.groups import part, part_names
from fedharness.errors import ConfigError
from fedharness.keys import Key, _is_list, _is_real, choice, number

KEYS: dict[str, Key] = {
    "client_lr": number("eta_L / gamma, the client step size", lo=0, lo_open=True, batchable=True),
    "lr_schedule": choice("constant | inverse_round | inverse_step | li_theory | step_decay", part_names("lr_schedule"),
                          batchable=True),
    "lr_beta": number("lr_schedule=inverse_step: eta_t = lr_beta / (t + lr_gamma)", lo=0, lo_open=True,
                      batchable=True),
    "lr_gamma": number("lr_schedule=inverse_step: offset gamma", lo=0, lo_open=True, batchable=True),
    "decay_at": Key(lambda v: _is_list(v, lambda f: _is_real(f) and 0 < f < 1) and len(v) > 0
                    and all(a < b for a, b in zip(v, v[1:])), "an increasing list of fractions in (0, 1)",
                    "lr_schedule=step_decay: fractions of the rounds where the lr is multiplied by decay_factor",
                    batchable=True),
    "decay_factor": number("lr_schedule=step_decay: factor", lo=0, hi=1, lo_open=True, batchable=True),
}


@part("lr_schedule", "constant")
class Constant(Schedule):
    def __init__(self, client_lr: float):
        self.client_lr = float(client_lr)

    def step_lrs(self, rnd: int, steps: int) -> np.ndarray:
        return np.full(steps, self.client_lr)


@part("lr_schedule", "inverse_round")
class InverseRound(Constant):
    """eta_r = eta_0 / (1 + r), constant within a round (Li et al.'s experiments)."""

    def step_lrs(self, rnd: int, steps: int) -> np.ndarray:
        return np.full(steps, self.client_lr / (1 + rnd))


class InverseStep(Schedule):
    """eta_t = beta / (t + gamma) per local step, t = rnd * period + step the global local-iteration counter.

    `period` is algorithm.local_steps (Li et al.'s E): the counter advances by E per round.
    """

    def __init__(self, beta: float, gamma: float, period: int):
        self.beta, self.gamma, self.period = float(beta), float(gamma), period

    @property
    def client_lr(self) -> float:
        return self.beta / self.gamma

    def step_lrs(self, rnd: int, steps: int) -> np.ndarray:
        t = rnd * self.period + np.arange(steps, dtype=np.float64)
        return self.beta / (t + self.gamma)


@part("lr_schedule", "inverse_step")
def inverse_step(lr_beta: float, lr_gamma: float, local_steps: int) -> InverseStep:
    """InverseStep from its keys: eta_t = lr_beta / (t + lr_gamma), the counter advancing by local_steps a round."""
    return InverseStep(lr_beta, lr_gamma, local_steps)


@part("lr_schedule", "li_theory")
def li_theory(problem: Problem, local_steps: int) -> InverseStep:
    """Li et al.'s Theorem 1 step size eta_t = 2 / (mu (gamma + t)), gamma = max(8 L / mu, E)."""
    L, mu = estimate_smoothness(problem)
    return InverseStep(2.0 / mu, max(8.0 * L / mu, float(local_steps)), local_steps)


@part("lr_schedule", "step_decay")
class StepDecay(Constant):
    """eta_r = eta_0 * factor^(number of boundaries passed); boundary i is round floor(decay_at[i] * rounds)."""

    def __init__(self, client_lr: float, decay_at, decay_factor: float, rounds: int | None = None):
        super().__init__(client_lr)
        if rounds is None:
            raise ConfigError("algorithm.lr_schedule", "step_decay",
                              "needs the number of rounds: build the algorithm through fedharness.runs.execute.prepare")
        self.boundaries = np.floor(np.asarray(decay_at, dtype=np.float64) * rounds).astype(np.int64)
        self.decay_factor = float(decay_factor)

    def step_lrs(self, rnd: int, steps: int) -> np.ndarray:
        passed = int((rnd >= self.boundaries).sum())
        return np.full(steps, self.client_lr * self.decay_factor ** passed)


# --- smoothness and strong convexity of a problem (for Li et al.'s theory step size) -------------------

def estimate_smoothness(problem: Problem, iters: int = 300, tol: float = 1e-7) -> tuple[float, float]:
    """(L, mu) as Li et al.'s assumptions use them: every F_k is L-smooth and mu-strongly convex.

    * Quadratics: exact, L = max_k lambda_max(A_k), mu = min_k lambda_min(A_k).
    * Data problems (convex models with an l2 term l2 ||w||^2): mu = 2 l2, the curvature the
      regulariser guarantees everywhere (the data term adds curvature only in some
      directions); L = max_k lambda_max(grad^2 F_k(0)), by power iteration on exact
      Hessian-vector products of each client's full-batch objective at w = 0 (the
      harness's starting point). For softmax regression the Hessian is largest near
      uniform predictions, so this is the relevant curvature for the first rounds.
    Raises ConfigError where mu does not exist (non-convex models, l2 = 0).
    """
    hessians = problem.hessians() if isinstance(problem, ExactSolve) else None
    if hessians is not None:
        eig = np.linalg.eigvalsh(hessians)
        return float(eig.max()), float(eig.min())
    objective = problem.objective
    l2 = 0.0 if objective is None else float(objective.l2 or 0.0)
    if objective is None or not problem.convex or l2 <= 0:
        raise ConfigError("algorithm.lr_schedule", "li_theory",
                          "needs a strongly convex problem: the quadratic dataset, or model=logreg/linreg "
                          "with model.l2 > 0")
    L = max(_client_lambda_max(problem, k, iters, tol) for k in range(problem.num_clients))
    return L, 2.0 * l2


def _client_lambda_max(problem: Problem, k: int, iters: int, tol: float) -> float:
    """Largest Hessian eigenvalue of client k's objective at w = 0, by power iteration in float64."""
    objective = problem.objective
    lo, n = int(problem.offsets[k]), int(problem.sizes[k])
    x = problem.x[lo:lo + n].to(torch.float64)
    y = problem.y[lo:lo + n]
    w = torch.zeros(1, problem.dim, dtype=torch.float64, device=x.device, requires_grad=True)
    loss = objective.loss_terms(w, x, y)[0].sum() / n + objective.regularizer(w).sum()
    (g,) = torch.autograd.grad(loss, w, create_graph=True)
    v = torch.as_tensor(np.random.default_rng(k).standard_normal((1, problem.dim)), dtype=torch.float64,
                        device=x.device)
    v, lam = v / v.norm(), 0.0
    for _ in range(iters):
        (hv,) = torch.autograd.grad(g, w, grad_outputs=v, retain_graph=True)
        new = float((v * hv).sum())
        v = hv / hv.norm()
        if abs(new - lam) <= tol * abs(new):
            return new
        lam = new
    return lam
