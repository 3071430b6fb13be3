"""pFedMe, Per-FedAvg and APFL against their closed forms on quadratic clients f_k(w) = 1/2 (w - e_k)^T A_k (w - e_k)
(A_k of different eigenvectors, eigenvalues in [0.5, 2]; unequal weights p_k; full participation; exact gradients;
float64). With P_k = I - (I - eta G_k)^tau, a method whose local step is w <- w - eta G_k (w - e_k) sends
Delta_k = -P_k (w - e_k), so the server's fixed point is w_tau(G) = (sum p_k P_k)^-1 sum p_k P_k e_k (any server_lr).
The runs start at w = 0 and contract to it geometrically; each test states its contraction and the rounds it runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness.assembly.build import algorithm_for
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.runs.execute import prepare

QUADRATIC = ("dataset=quadratic", "dataset.num_clients=6", "dataset.dim=3", "dataset.curvature=random",
             "dataset.mu=0.5", "dataset.L=2.0", "dataset.spread=2.0", "dtype=float64", "algorithm.sampler=full",
             "progress=false")
UNEQUAL_P = np.array([0.4, 0.05, 0.25, 0.1, 0.15, 0.05])
REL = 1e-8  # the bound; the contractions below leave < 1e-12 of the start's distance after the rounds run


def _run(run_config, rounds: int, *overrides: str):
    """The engine and outcome of `rounds` rounds on the quadratic with weights UNEQUAL_P, and the problem."""
    cfg = run_config(*QUADRATIC, *overrides)
    problem, _, _ = prepare(cfg)
    problem = QuadraticProblem(problem.A_np, problem.e_np, UNEQUAL_P, dtype=torch.float64)
    algorithm = algorithm_for(cfg, problem)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=rounds, seed=cfg.seed,
                    replicas=1, eval_every=rounds, reference=None)
    outcome = engine.run()
    assert outcome.status == "ok"
    return engine, outcome, problem


def fixed_point(A: np.ndarray, e: np.ndarray, p: np.ndarray, G: np.ndarray, eta: float, tau: int) -> np.ndarray:
    """w_tau(G) = (sum p_k P_k)^-1 sum p_k P_k e_k, P_k = I - (I - eta G_k)^tau."""
    eye = np.eye(A.shape[1])
    P = np.stack([eye - np.linalg.matrix_power(eye - eta * g, tau) for g in G])
    return np.linalg.solve(np.einsum("k,kij->ij", p, P), np.einsum("k,kij,kj->i", p, P, e))


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


# pFedMe: lambda = 1, inner lr nu = 0.3, K = 40: C_k = I - nu (A_k + lambda I) has eigenvalues in
# [1 - 0.3 * 3, 1 - 0.3 * 1.5] = [0.1, 0.55], so ||C_k^K|| <= 0.55^40 = 4e-11 < 1e-10: the inner problem is solved.
# Its local step is then w <- w - eta lambda M_k (w - e_k), M_k = (A_k + lambda I)^-1 A_k (eigenvalues of
# lambda M_k in [1/3, 2/3]); at eta = 0.5 the server map's contraction is at most 1 - 0.5/3 per local step.
PFEDME = ("algorithm=pfedme", "algorithm.pfedme_lambda=1.0", "algorithm.pfedme_inner_lr=0.3",
          "algorithm.pfedme_inner_steps=40", "algorithm.client_lr=0.5")


def _pfedme_G(A: np.ndarray, lam: float) -> np.ndarray:
    eye = np.eye(A.shape[1])
    return np.stack([lam * np.linalg.solve(a + lam * eye, a) for a in A])


@pytest.mark.parametrize("R, beta, rounds", [(1, 1.0, 200), (1, 0.5, 400), (3, 1.0, 80)])
def test_pfedme_reaches_its_closed_form(run_config, R, beta, rounds):
    """R = 1: (sum p_k M_k)^-1 sum p_k M_k e_k for any beta; R = 3: w_3(lambda M_k). Contraction per round at least
    (1 - beta (1 - (5/6)^R)): after the rounds run, below 1e-12 of the start's distance (R = 1, beta = 0.5: 0.92^400)."""
    engine, outcome, problem = _run(run_config, rounds, *PFEDME, f"algorithm.local_steps={R}", f"algorithm.server_lr={beta}")
    A, e = problem.A_np, problem.e_np
    M = _pfedme_G(A, 1.0)
    if R == 1:
        want = np.linalg.solve(np.einsum("k,kij->ij", UNEQUAL_P, M), np.einsum("k,kij,kj->i", UNEQUAL_P, M, e))
    else:
        want = fixed_point(A, e, UNEQUAL_P, M, 0.5, R)
    x = outcome.state.x.numpy()[0]
    assert _rel(x, want) < REL
    # not FedAvg's point: the Moreau envelope moves it (measured below)
    assert _rel(want, fixed_point(A, e, UNEQUAL_P, A, 0.5, R)) > 1e-3


# Per-FedAvg: a = 0.2 < 1 / lambda_max(A_k) = 0.5; G_k = (I - a A_k) A_k (I - a A_k) (HF) or A_k (I - a A_k) (FO).
# On A_k's eigenvectors G_k has eigenvalues lambda (1 - a lambda)^2 in [0.32, 0.72] (HF) and lambda (1 - a lambda) in
# [0.45, 1.2] (FO; G_k is symmetric: A_k and I - a A_k commute); eta = 0.5 contracts each local step by at least
# 1 - 0.5 * 0.32 = 0.84.
@pytest.mark.parametrize("tau", [1, 4])
def test_perfedavg_fo_and_hf_reach_their_closed_forms(run_config, tau):
    a, eta, rounds = 0.2, 0.5, 200
    out = {}
    for variant in ("fo", "hf"):
        engine, outcome, problem = _run(run_config, rounds, f"algorithm=perfedavg_{variant}", f"algorithm.perfedavg_step={a}",
                               f"algorithm.client_lr={eta}", f"algorithm.local_steps={tau}")
        out[variant] = outcome.state.x.numpy()[0]
    A, e = problem.A_np, problem.e_np
    eye = np.eye(A.shape[1])
    fo = np.stack([k @ (eye - a * k) for k in A])
    hf = np.stack([(eye - a * k) @ k @ (eye - a * k) for k in A])
    want_fo, want_hf = fixed_point(A, e, UNEQUAL_P, fo, eta, tau), fixed_point(A, e, UNEQUAL_P, hf, eta, tau)
    assert _rel(out["fo"], want_fo) < REL
    assert _rel(out["hf"], want_hf) < REL
    assert _rel(want_hf, want_fo) > 1e-2  # the two variants' points differ (measured in the report)
