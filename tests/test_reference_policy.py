"""`reference: auto | on | off`: solve only where the optimum exists, within a time bound, once per data set."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedharness.assembly import reference_policy
from fedharness.errors import ConfigError
from fedharness.references.solve import solve_reference
from fedharness.runs.execute import execute, prepare

SMALL = ("dataset.num_clients=4", "dataset.samples_per_client=40", "rounds=2", "eval_every=1")
STRONGLY_CONVEX = (*SMALL, "model.l2=0.01")
# two tight blobs, far apart: linearly separable, so without l2 the logistic loss has no minimiser
SEPARABLE = ("dataset=blobs", "dataset.std=0.05", "dataset.num_clients=4", "dataset.samples_per_client=50",
             "model=logreg", "model.l2=0", "rounds=2", "eval_every=1")


@pytest.fixture
def solves(monkeypatch, tmp_path):
    """Counts exact solves, with an empty reference cache and nothing reported yet in this process."""
    monkeypatch.setenv("FEDHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(reference_policy, "_REPORTED", set())
    calls = []

    def counted(problem, **kw):
        calls.append(problem)
        return solve_reference(problem, **kw)

    monkeypatch.setattr(reference_policy, "solve_reference", counted)
    return calls


def _rows(results_dir):
    return pd.read_parquet(results_dir / "runs").iloc[0], pd.read_parquet(results_dir / "rounds")


def test_auto_skips_an_objective_without_a_minimiser(run_config, tmp_path, solves, caplog):
    execute(run_config(*SEPARABLE))
    run, rounds = _rows(tmp_path / "results")
    assert solves == []
    assert pd.isna(run["f_star"]) and pd.isna(run["gamma_heterogeneity"])
    assert rounds["subopt"].isna().all() and rounds["dist_to_opt"].isna().all()
    assert rounds["train_loss"].notna().all()
    err = caplog.text  # logged warnings: the CLI shows them on stderr as `fedharness: <message>`
    assert err.count("no exact reference: model.l2=0 (the optimum may not exist)") == 1
    assert "reference=on forces a solve" in err


def test_off_never_solves(run_config, tmp_path, solves):
    execute(run_config(*STRONGLY_CONVEX, "reference=off"))
    run, rounds = _rows(tmp_path / "results")
    assert solves == [] and pd.isna(run["f_star"]) and rounds["subopt"].isna().all()


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_strongly_convex_reference_is_the_newton_solution(run_config, tmp_path, solves, mode):
    cfg = run_config(*STRONGLY_CONVEX, "dtype=float64", f"reference={mode}", "heterogeneity=false")
    problem, _, reference = prepare(cfg)
    direct = solve_reference(problem)
    assert reference.f_star == pytest.approx(direct.f_star, rel=1e-12)
    np.testing.assert_allclose(reference.w_star, direct.w_star, rtol=1e-9, atol=1e-12 * np.abs(direct.w_star).max())
    _, g = problem.with_dtype(torch.float64).objective_and_grad(torch.as_tensor(reference.w_star)[None])
    assert float(g.norm()) < 1e-8  # a true stationary point
    execute(cfg)
    run, rounds = _rows(tmp_path / "results")
    assert run["f_star"] == pytest.approx(direct.f_star, rel=1e-12)
    assert (rounds["subopt"] >= -1e-12 * direct.f_star).all() and rounds["dist_to_opt"].notna().all()


def test_a_solve_over_its_time_bound_is_skipped_under_auto_and_an_error_under_on(run_config, tmp_path, solves,
                                                                                   caplog):
    execute(run_config(*STRONGLY_CONVEX, "reference_timeout_s=1e-9"))  # over the bound before its first CG step
    run, rounds = _rows(tmp_path / "results")
    assert len(solves) == 1 and pd.isna(run["f_star"]) and rounds["subopt"].isna().all()
    err = caplog.text
    assert err.count("no exact reference: Newton-CG did not converge within the time bound") == 1
    assert "reference_timeout_s=1e-09" in err
    with pytest.raises(ConfigError, match=r"'reference': 'on'.*time bound.*reference_timeout_s"):
        execute(run_config(*STRONGLY_CONVEX, "reference_timeout_s=1e-9", "reference=on",
                           f"results_dir={tmp_path / 'on'}"))
    assert not (tmp_path / "on").exists()  # stopped before any result file
    assert len(solves) == 1  # the failure was cached: no second wait for the same bound
    prepare(run_config(*STRONGLY_CONVEX, "reference_timeout_s=60", "reference=on"))  # more time: solved again
    assert len(solves) == 2


def test_runs_on_the_same_data_share_one_solve(run_config, solves):
    same_data = ("dataset.data_seed=7", "heterogeneity=false")
    for seed in (0, 1, 2):
        _, _, reference = prepare(run_config(*STRONGLY_CONVEX, *same_data, f"seed={seed}"))
    assert len(solves) == 1
    _, _, other = prepare(run_config(*STRONGLY_CONVEX, "dataset.data_seed=8", "heterogeneity=false"))
    assert len(solves) == 2 and other.f_star != pytest.approx(reference.f_star, rel=1e-6)
    prepare(run_config(*STRONGLY_CONVEX, "heterogeneity=false", "seed=7"))  # data_seed null: the seed draws the data
    assert len(solves) == 2
    prepare(run_config(*STRONGLY_CONVEX, *same_data, "partition=iid"))  # same samples, another split
    assert len(solves) == 3


def test_client_minima_over_the_time_bound_leave_gamma_null_under_auto(run_config, tmp_path, solves, monkeypatch,
                                                                        caplog):
    cfg = run_config(*STRONGLY_CONVEX)
    prepare(cfg)  # the global reference, solved and cached within the default bound
    cfg = cfg.replace(reference_timeout_s=1e-9)
    execute(cfg)
    run, _ = _rows(tmp_path / "results")
    assert run["f_star"] > 0 and pd.isna(run["gamma_heterogeneity"])
    assert "no heterogeneity Gamma (clients' minima F_k*): Newton-CG did not converge" in caplog.text


def test_bad_values_and_impossible_requests_are_config_errors(run_config):
    with pytest.raises(ConfigError, match=r"'reference': 'maybe'.*auto, on, off"):
        prepare(run_config(*SMALL, "reference=maybe"))
    with pytest.raises(ConfigError, match=r"'reference_timeout_s': -1.*> 0"):
        prepare(run_config(*SMALL, "reference_timeout_s=-1"))
    with pytest.raises(ConfigError, match=r"'reference': 'on'.*model=2nn is not convex"):
        prepare(run_config(*SMALL, "model=2nn", "reference=on"))
    assert reference_policy.settings({"reference": True}) == ("on", 600.0)  # YAML reads a bare `on` as true


def test_solver_reports_its_progress(run_config):
    problem, _, _ = prepare(run_config(*STRONGLY_CONVEX, "reference=off"))
    seen = []
    ref = solve_reference(problem, progress=lambda newton, cg, gnorm: seen.append((newton, cg, gnorm)))
    newton_steps = sorted({n for n, _, _ in seen})
    assert newton_steps == list(range(len(newton_steps))) and len(newton_steps) >= 2
    norms = [g for _, cg, g in seen if cg == 1]  # ||grad F|| at the start of each Newton step
    assert norms[-1] < 1e-2 * norms[0] and ref.grad_norm < 1e-8
