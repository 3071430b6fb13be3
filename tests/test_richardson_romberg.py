"""Mangold et al.: FedAvg's stationary mean on heterogeneous quadratics, its O(gamma) bias, and the
Richardson-Romberg extrapolation (over gamma and over H) that cancels the first-order term."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedharness.references import closed_forms as cf
from fedharness.errors import ConfigError
from fedharness.runs.execute import execute
from quadratic_runs import run_engine

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

H = 4
# Heterogeneous gradients and Hessians (random curvature in [1, 3]): b_h != 0. Full participation, equal weights.
QUAD = ("dataset=quadratic", "dataset.num_clients=5", "dataset.dim=3", "dataset.curvature=random",
        "dataset.mu=1.0", "dataset.L=3.0", "algorithm.sampler=full", f"algorithm.local_steps={H}",
        "dtype=float64")


@pytest.fixture(scope="module")
def deterministic(tmp_path_factory):
    """rr=gamma at gamma = 0.01 and 0.02 (chains at 0.01/0.02 and 0.02/0.04), rr=H at gamma = 0.01 and 0.02."""
    from fedharness.config.load import load_settings

    out = {}
    for kind in ("gamma", "H"):
        for lr in (0.01, 0.02):
            cfg = load_settings([f"results_dir={tmp_path_factory.mktemp('r')}", "progress=false", *QUAD,
                               f"algorithm.client_lr={lr}", f"algorithm.rr={kind}", "algorithm.burn_in=0.5",
                               "rounds=1000"])
            out[kind, lr] = run_engine(cfg, series_from_config=True)
    return out


def _quad(res):
    return res.problem.A_np, res.problem.e_np, cf.optimum(res.problem.A_np, res.problem.e_np)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 9 s idle
def test_fedavg_stationary_point_matches_mangold_closed_form(deterministic):
    for lr in (0.01, 0.02):
        res = deterministic["gamma", lr]
        A, e, _ = _quad(res)
        for x, factor in zip(res.x, (1, 2)):  # replica 0 at gamma, replica 1 at 2 gamma
            assert np.abs(x - cf.mangold_stationary_mean(A, e, factor * lr, H)).max() < 1e-8


def test_fedavg_bias_is_linear_in_gamma(deterministic):
    A, e, theta = _quad(deterministic["gamma", 0.01])
    bias = {0.01: deterministic["gamma", 0.01].x[0] - theta, 0.02: deterministic["gamma", 0.02].x[0] - theta,
            0.04: deterministic["gamma", 0.02].x[1] - theta}
    first = cf.first_order_bias(A, e, None, 1.0, H)  # bias per unit gamma, to first order: (H - 1)/2 b_h
    for lr, b in bias.items():
        assert np.linalg.norm(b / lr - first) < 0.02 * np.linalg.norm(first)
    assert np.linalg.norm(bias[0.02]) / np.linalg.norm(bias[0.01]) == pytest.approx(2.0, rel=0.02)
    assert np.linalg.norm(bias[0.01]) > 1e-3  # a real bias, far above the 1e-8 convergence error


@pytest.mark.parametrize("kind", ["gamma", "H"])
def test_richardson_romberg_cancels_first_order_bias(deterministic, kind):
    a, b = cf.rr_coefficients(kind, H)
    resid = {}
    for lr in (0.01, 0.02):
        res = deterministic[kind, lr]
        A, e, theta = _quad(res)
        series = res.series()
        np.testing.assert_allclose(series["rr"][0], a * res.x[0] + b * res.x[1], rtol=0, atol=1e-14)
        expected = cf.rr_stationary_mean(A, e, lr, H, kind)
        assert np.abs(series["rr"][0] - expected).max() < 1e-8
        assert np.abs(series["rr_average"][0] - expected).max() < 1e-8  # deterministic: average = limit
        np.testing.assert_allclose(series["average"], res.x, atol=1e-8)
        resid[lr] = np.linalg.norm(series["rr"][0] - theta)
        assert resid[lr] < 0.1 * np.linalg.norm(res.x[0] - theta)  # far below FedAvg's own bias
    # second order: halving gamma cuts RR's residual ~4x (FedAvg's bias only 2x, previous test)
    assert 3.0 < resid[0.02] / resid[0.01] < 5.0


def _noisy(run_config, shared: bool, rounds: int):
    cfg = run_config(*QUAD, "dataset.noise=0.5", "algorithm.client_lr=0.02", "algorithm.rr=gamma",
                     f"algorithm.rr_shared_noise={str(shared).lower()}", "algorithm.burn_in=0.1", "replicas=16",
                     f"rounds={rounds}")
    return run_engine(cfg, series_from_config=True)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_noisy_stationary_mean_and_rr_average(run_config):
    """With gradient noise the iterates wander, but the stationary mean keeps the closed form (quadratics:
    no stochastic bias), the Polyak-Ruppert averages estimate it, and RR's average removes most of the bias."""
    res = _noisy(run_config, shared=True, rounds=2000)
    A, e, theta = _quad(res)
    R = 16
    avg = res.series()["average"]
    rr_avg = res.series()["rr_average"]
    for x, lr in ((avg[:R], 0.02), (avg[R:], 0.04)):
        mean, se = x.mean(0), x.std(0, ddof=1) / np.sqrt(R)
        closed = cf.mangold_stationary_mean(A, e, lr, H)
        assert (np.abs(mean - closed) < 5 * se + 1e-4).all()
        assert np.linalg.norm(closed - theta) > 10 * np.linalg.norm(se)  # the bias is resolved, not noise
    fedavg_err = np.linalg.norm(avg[:R].mean(0) - theta)
    rr_err = np.linalg.norm(rr_avg.mean(0) - theta)
    assert rr_err < 0.25 * fedavg_err
    assert res.x.std(0).max() > 10 * np.abs(avg[:R].mean(0) - cf.mangold_stationary_mean(A, e, 0.02, H)).max()


def test_shared_noise_couples_the_chains(run_config):
    # 2 theta^(gamma) - theta^(2 gamma): with shared random numbers the fluctuations partly cancel
    spread = {shared: _noisy(run_config, shared, 300).series()["rr"].std(0).mean() for shared in (True, False)}
    assert spread[True] < 0.7 * spread[False]


def test_rr_rows_in_results(run_config, tmp_path):
    cfg = run_config(*QUAD, "algorithm=fedavg_rr", "algorithm.client_lr=0.02", "replicas=2", "rounds=600",
                     "eval_every=300")
    result = execute(cfg)
    rounds = pd.read_parquet(tmp_path / "results" / "rounds")
    last = rounds[rounds["round"] == 600]
    counts = last.groupby("series")["replica"].apply(lambda r: sorted(r.tolist())).to_dict()
    assert counts == {"iterate": [0, 1, 2, 3], "average": [0, 1, 2, 3], "rr": [0, 1], "rr_average": [0, 1]}
    problem = run_engine(cfg).problem
    A, e, theta = problem.A_np, problem.e_np, cf.optimum(problem.A_np, problem.e_np)
    expected = np.linalg.norm(cf.rr_stationary_mean(A, e, 0.02, H) - theta)
    np.testing.assert_allclose(last[last["series"] == "rr"]["dist_to_opt"], expected, rtol=1e-6)
    iterate = last[last["series"] == "iterate"].sort_values("replica")
    np.testing.assert_allclose(iterate["lr"], [0.02, 0.02, 0.04, 0.04])  # replicas R.. run at 2 gamma
    assert result.status == "ok"


@pytest.mark.parametrize("override, key", [
    (("algorithm.rr=sometimes",), "algorithm.rr"),
    (("algorithm.rr=H", "algorithm.local_work=epochs"), "algorithm.local_work"),
    (("algorithm.burn_in=1.5",), "algorithm.burn_in"),
    (("algorithm.average=maybe",), "algorithm.average"),
])
def test_bad_rr_config_stops_before_any_file(run_config, tmp_path, override, key):
    with pytest.raises(ConfigError) as err:  # the schema (load_settings) or the run's build refuses it
        execute(run_config(*QUAD, *override, "rounds=2"))
    assert key in str(err.value)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("shared", [True, False])
def test_coupled_chains_start_from_the_same_point(run_config, shared):
    # a net's initial point is drawn per replica: replica R + r must start where replica r does
    from fedharness.core.engine import Engine
    from fedharness.core.executors import InlineExecutor
    from fedharness.runs.execute import prepare
    from fedharness.algorithms.series import build_series

    cfg = run_config("dataset.num_clients=4", "dataset.samples_per_client=10", "model=2nn", "algorithm=fedavg_rr",
                     f"algorithm.rr_shared_noise={str(shared).lower()}", "replicas=3")
    problem, algorithm, _ = prepare(cfg)
    layout, series = build_series(3, **cfg.algorithm.params)
    x = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=1, seed=0, replicas=3,
               eval_every=1, layout=layout, series=series).initial_state().x
    assert len(x) == 6
    torch.testing.assert_close(x[:3], x[3:], rtol=0, atol=0)
    assert (x[0] - x[1]).abs().max() > 1e-3  # the seeds themselves differ
    np.testing.assert_array_equal(layout.stream_ids, [0, 1, 2, 0, 1, 2] if shared else [0, 1, 2, 3, 4, 5])


def test_resumed_run_continues_the_averages(run_config, tmp_path):
    # the Polyak-Ruppert sums live in the run state: a crash and a resume give the same rows
    overrides = (*QUAD, "dataset.noise=0.5", "algorithm=fedavg_rr", "algorithm.client_lr=0.02", "replicas=2",
                 "rounds=12", "eval_every=1", "checkpoint_every=4", "algorithm.burn_in=0.25")

    def crash(rows, state):
        if state.round == 10:
            raise RuntimeError("driver crashed")

    crashed = run_config(*overrides, f"results_dir={tmp_path / 'a'}")
    with pytest.raises(RuntimeError):
        execute(crashed, run_id="victim", on_eval=crash)
    execute(run_config(*overrides, f"results_dir={tmp_path / 'a'}", "resume=victim"))
    execute(run_config(*overrides, f"results_dir={tmp_path / 'b'}"))
    cols = ["series", "replica", "round", "dist_to_opt", "train_loss"]
    a, b = (pd.read_parquet(tmp_path / d / "rounds")[cols].sort_values(cols[:3]).reset_index(drop=True)
            for d in ("a", "b"))
    assert set(a["series"]) == {"iterate", "average", "rr", "rr_average"} and len(a) == len(b)
    pd.testing.assert_frame_equal(a, b, rtol=1e-12)
