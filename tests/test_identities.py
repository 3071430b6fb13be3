"""Identities of the reproductions asserted on a small case in the default run (their full-size checks are in
tests/test_reproductions.py, CI-only since ea0c0ba): FedAvg with heterogeneous local steps stalls at Wang et al.'s
surrogate optimum (Lemma 1), and the Richardson-Romberg run's gamma chain is FedAvg itself (Mangold et al.)."""

from __future__ import annotations

import numpy as np
import pyarrow.dataset as ds
import pytest

from fedharness.assembly.build import build_parts
from fedharness.config.load import load_settings
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import execute

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def test_fedavg_with_heterogeneous_local_steps_stalls_at_the_lemma_1_surrogate_on_a_small_case():
    """Wang et al. (FedNova), Lemma 1: on F_i = 1/2 ||x - e_i||^2 with fixed tau_i, FedAvg's limit as eta -> 0 is
    the surrogate optimum sum p_i tau_i e_i / sum p_i tau_i, not the optimum sum p_i e_i. Six clients, tau_i in
    [1, 16], 15 rounds at eta = 0.05 then 45 at 0.005 (eta tau_i <= 0.08): the final iterate within 10% of the
    gap from the surrogate, its distance to the optimum within 10% of that gap (the full-size test's band)."""
    rounds, tau = 60, [1, 3, 16, 2, 8, 12]
    settings = load_settings(["experiment=wang_quadratic", f"rounds={rounds}", f"eval_every={rounds}",
                              "dataset.num_clients=6", f"algorithm.client_steps={tau}", "algorithm.decay_at=[0.25]",
                              "algorithm.decay_factor=0.1", "reference=off", "progress=false"])
    problem, algorithm = build_parts(settings)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 1), rounds=rounds, seed=0,
                    replicas=1, eval_every=rounds)
    state = engine.initial_state()
    for _ in range(rounds):
        state = engine.step(state)
    x = state.x[0].double().numpy()
    p, steps = problem.weights, np.asarray(tau, float)
    surrogate = (p * steps) @ problem.e_np / (p * steps).sum()
    optimum = problem.optimum()
    np.testing.assert_allclose(optimum, p @ problem.e_np, rtol=1e-12)  # identity curvature: the plain mean
    gap = np.linalg.norm(surrogate - optimum)
    assert gap > 0.3 * np.linalg.norm(optimum)  # the two limits are far apart here
    assert np.linalg.norm(x - surrogate) < 0.1 * gap  # found: 0.04
    assert 0.9 * gap < np.linalg.norm(x - optimum) < 1.1 * gap  # found: 0.97


def test_the_rr_runs_gamma_chain_is_fedavg_itself_on_a_small_case(tmp_path):
    """Mangold et al.'s Richardson-Romberg run (algorithm=fedavg_rr) trains coupled chains at gamma and 2 gamma;
    its gamma chain shares FedAvg's seeds and streams, so its iterate and average series (replicas < R) are
    FedAvg's: the same distance to theta* at every evaluation, while the extrapolation (rr_average) differs."""
    common = [f"results_dir={tmp_path}", "experiment=mangold_noisy", "rounds=20", "eval_every=10", "replicas=2",
              "reference=on", "progress=false"]
    for algorithm in ("fedavg", "fedavg_rr"):
        assert execute(load_settings([*common, f"algorithm={algorithm}"]), run_id=algorithm).status == "ok"

    def distances(run_id: str, series: str) -> dict:
        rows = ds.dataset(tmp_path / "rounds" / f"run_id={run_id}", format="parquet").to_table().to_pylist()
        return {(r["replica"], r["round"]): r["dist_to_opt"] for r in rows if r["series"] == series and r["replica"] < 2}

    for series in ("iterate", "average"):
        fedavg, chain = distances("fedavg", series), distances("fedavg_rr", series)
        assert sorted(fedavg) == sorted(chain) and len(fedavg) == 6  # 2 replicas x rounds 0, 10, 20
        assert [chain[k] for k in sorted(fedavg)] == pytest.approx([fedavg[k] for k in sorted(fedavg)], rel=1e-9)
    extrapolated = distances("fedavg_rr", "rr_average")
    assert extrapolated[(0, 20)] != pytest.approx(distances("fedavg", "average")[(0, 20)], rel=1e-3)
