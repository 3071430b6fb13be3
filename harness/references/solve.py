"""Exact references for convex problems: w* and F* from a float64 Newton-CG solve."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from fedharness.contracts import ClosedForm, ExactSolve, Problem

# progress(newton_iteration, cg_iteration, ||grad F||), called as the solve goes
SolveProgress = Callable[[int, int, float], None]


@dataclass
class Reference:  # a fedharness.contracts.Reference
    w_star: np.ndarray  # float64 [dim]
    f_star: float
    grad_norm: float


class SolveFailed(RuntimeError):
    """The solve did not reach ||grad F|| < tol (within its iterations or its time bound)."""


def optimum_doubt(problem: Problem) -> str | None:
    """Why the minimiser of F may not exist or not be unique; None when F is strongly convex for sure."""
    if isinstance(problem, ClosedForm):  # quadratics: strongly convex iff sum p_i A_i is positive definite
        lowest = float(np.linalg.eigvalsh(problem.hessian_sum())[0])
        return None if lowest > 0 else f"the Hessian sum p_i A_i is singular (lowest eigenvalue {lowest:.3g})"
    l2 = 0.0 if problem.objective is None else problem.objective.l2
    return None if l2 > 0 else f"model.l2={l2:g} (the optimum may not exist)"


def solve_reference(problem: ExactSolve, tol: float = 1e-9, max_iter: int = 100, timeout_s: float | None = None,
                    progress: SolveProgress | None = None) -> Reference:
    """Minimise the global objective in float64 until ||grad F|| < tol; SolveFailed if it does not get there.

    Quadratics use their closed form; other convex problems use Newton's method with
    conjugate-gradient steps on exact Hessian-vector products and an Armijo line search,
    given up after `timeout_s` seconds (None: no bound).
    """
    p64 = problem.with_dtype(torch.float64)
    if isinstance(p64, ClosedForm):
        w = torch.as_tensor(p64.optimum(), dtype=torch.float64).unsqueeze(0)
    else:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        w = _newton_cg(p64, torch.zeros(1, p64.dim, dtype=torch.float64, device=p64.device), tol, max_iter,
                       deadline, progress or _quiet)
    f, g = p64.objective_and_grad(w)
    gnorm = float(g.norm())
    if gnorm >= tol * 10:
        raise SolveFailed(f"Newton-CG stopped after {max_iter} iterations at ||grad F|| = {gnorm:.3e} > {tol:.0e}")
    return Reference(w[0].cpu().numpy(), float(f[0]), gnorm)


def _hvp(problem, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    w = w.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(problem.objective_value(w).sum(), w, create_graph=True)
    (hv,) = torch.autograd.grad((g * v).sum(), w)
    return hv


def _check_time(deadline: float | None, gnorm: float) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise SolveFailed(f"Newton-CG did not converge within the time bound (||grad F|| = {gnorm:.3e})")


def _conjugate_gradient(problem, w, g, tol, tick: Callable[[int], None]) -> torch.Tensor:
    d, r = torch.zeros_like(g), -g.clone()
    p, rr = r.clone(), (r * r).sum()
    for i in range(200):
        tick(i + 1)
        hp = _hvp(problem, w, p)
        alpha = rr / (p * hp).sum()
        d, r = d + alpha * p, r - alpha * hp
        rr_new = (r * r).sum()
        if rr_new.sqrt() < tol:
            break
        p, rr = r + (rr_new / rr) * p, rr_new
    return d


def _quiet(newton: int, cg: int, grad_norm: float) -> None:
    pass


def _newton_cg(problem, w: torch.Tensor, tol: float, max_iter: int, deadline: float | None = None,
               progress: SolveProgress = _quiet) -> torch.Tensor:
    for it in range(max_iter):
        f, g = problem.objective_and_grad(w)
        gnorm = float(g.norm())
        if gnorm < tol:
            break

        def tick(cg: int) -> None:  # one CG step can take seconds on large data: report and check the time
            progress(it, cg, gnorm)
            _check_time(deadline, gnorm)

        d = _conjugate_gradient(problem, w, g, min(0.5, gnorm ** 0.5) * gnorm, tick)
        step, slope = 1.0, float((g * d).sum())
        while step > 1e-12:
            f_new = problem.objective_value(w + step * d)
            if float(f_new) <= float(f) + 1e-4 * step * slope:
                break
            step *= 0.5
        w = (w + step * d).detach()
    return w
