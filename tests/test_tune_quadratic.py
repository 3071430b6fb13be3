"""TPE finds the analytic best constant step of gradient descent on a quadratic.

With full participation and one local step, FedAvg's round is a GD step on
F(x) = sum_i p_i 1/2 (x - e_i)^T A_i (x - e_i), whose Hessian is H = sum_i p_i A_i:
x_{t+1} - x* = (I - gamma H)(x_t - x*). The contraction max_j |1 - gamma lambda_j| is smallest at
gamma* = 2 / (lambda_min(H) + lambda_max(H)), and for many rounds the final distance ||x_T - x*||
is minimised there (for T = 30 on this instance the numerical argmin is 1.0015 gamma*).
"""

from __future__ import annotations

import pytest
import numpy as np
import pandas as pd

from fedharness import cli
from fedharness.config.load import load_config
from fedharness.problems import build_problem
from fedharness.settings import RunSettings
from fedharness.studies.tuning.spec import build_spec




def analytic_step() -> float:
    spec = build_spec(["tune=quadratic_lr"], probe=False)
    cfg = load_config(list(spec.run_overrides))
    problem = build_problem(RunSettings.from_config(cfg), cfg["algorithm"]["batch_size"])
    H = np.einsum("n,nde->de", problem.weights, problem.A_np)
    lam = np.linalg.eigvalsh(H)
    return 2.0 / (lam.min() + lam.max())


def test_finite_horizon_optimum_is_the_analytic_step():
    """The claim the tuning test relies on, checked by direct GD on the same instance."""
    spec = build_spec(["tune=quadratic_lr"], probe=False)
    cfg = load_config(list(spec.run_overrides))
    problem = build_problem(RunSettings.from_config(cfg), 1)
    H = np.einsum("n,nde->de", problem.weights, problem.A_np)
    w_star = problem.optimum()

    def final_distance(gamma: float) -> float:
        x = np.zeros(len(w_star))
        for _ in range(spec.budget.total):
            x = x - gamma * H @ (x - w_star)
        return float(np.linalg.norm(x - w_star))

    g = analytic_step()
    grid = np.geomspace(g / 4, 4 * g, 801)
    best = grid[np.argmin([final_distance(v) for v in grid])]
    assert abs(best / g - 1) < 0.01


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 4 s idle
def test_tpe_lands_within_2x_of_the_analytic_step(tmp_path):
    code = cli.main(["tune", "tune=quadratic_lr", f"results_dir={tmp_path}", "tune.plots=false"])
    assert code == 0
    trials = pd.read_parquet(tmp_path / "trials")
    assert len(trials) == 20 and trials.state.eq("COMPLETE").all()
    best = trials.loc[trials.value.idxmin()]
    g = analytic_step()
    assert g / 2 <= best.param_client_lr <= 2 * g, (best.param_client_lr, g)
    # and the search space was wide: 1e-3 .. 1 spans 10x below and 50x above gamma*
    assert trials.param_client_lr.min() < g / 2 and trials.param_client_lr.max() > 2 * g
