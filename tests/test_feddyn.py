"""FedDyn (Acar et al. 2021): on heterogeneous quadratics with the local problems solved to tolerance it reaches the
exact optimum, where FedAvg with the same local steps stalls at a biased point, and its fixed point does not depend
on E; with unequal client weights p_k (each f_k scaled by N p_k) the optimum of sum p_k f_k; with partial
participation below FedAvg's floor. Its g_k live in the shards: the same rows on 1 and 3 shards, in a batch,
resumed and on Ray. Combinations outside the paper are refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness import cli
from fedharness.assembly.build import algorithm_for
from fedharness.config.load import load_settings
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.runs.batch import Slot
from fedharness.runs.execute import execute, execute_batch, prepare
from ray_support import read_rounds
from test_client_store import CrashAt

# Eigenvalues of A_k in [0.5, 2]; with alpha = 1 the local problem a client's SGD solves (FedDynSGD: divided by
# N p_k) has Hessian A_k + alpha / (N p_k) I, eigenvalues in [1.5, 3] (equal weights) or in
# [0.5 + 1 / 2.4, 2 + 1 / 0.3] = [0.92, 5.33] (UNEQUAL_P), so E = 100 steps of size 0.3 contract its error by at
# most max |1 - 0.3 lambda| ^ 100 = 0.725 ^ 100 ~ 1e-14: solved to tolerance. E = 5 is not.
QUADRATIC = ("dataset=quadratic", "dataset.num_clients=6", "dataset.dim=3", "dataset.curvature=random",
             "dataset.mu=0.5", "dataset.L=2.0", "dataset.spread=2.0", "dtype=float64", "algorithm.client_lr=0.3",
             "algorithm.feddyn_alpha=1.0", "progress=false")
SOLVED, UNSOLVED = 100, 5
FULL = ("algorithm.sampler=full",)
PARTIAL = ("algorithm.sampler=yang_s2", "algorithm.clients_per_round=3", "replicas=2")
UNEQUAL_P = np.array([0.4, 0.05, 0.25, 0.1, 0.15, 0.05])


def _run(cfg, rounds: int, weights: np.ndarray | None = None, eval_every: int | None = None):
    """The run's engine and outcome; `weights`: the same quadratic with these client weights p_k."""
    problem, _, reference = prepare(cfg)
    if weights is not None:
        problem = QuadraticProblem(problem.A_np, problem.e_np, weights, dtype=torch.float64)
        reference = None
    algorithm = algorithm_for(cfg, problem)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=rounds, seed=cfg.seed,
                    replicas=cfg.replicas, eval_every=eval_every or rounds, reference=reference)
    outcome = engine.run()
    assert outcome.status == "ok"
    return engine, outcome


def _final(run_config, name: str, steps: int, *extra: str, rounds: int = 80, weights=None) -> np.ndarray:
    cfg = run_config(*QUADRATIC, f"algorithm={name}", f"algorithm.local_steps={steps}", *extra)
    return _run(cfg, rounds, weights)[1].state.x.numpy()


def _subopt(problem: QuadraticProblem, x: np.ndarray) -> np.ndarray:
    """F(x) - F* in float64, F* at the closed-form optimum."""
    w_star = torch.as_tensor(problem.optimum())[None]
    return (problem.objective_value(torch.as_tensor(x)) - problem.objective_value(w_star)).numpy()


def test_feddyn_reaches_the_optimum_where_fedavg_stalls_and_its_fixed_point_does_not_depend_on_E(run_config):
    cfg = run_config(*QUADRATIC, "algorithm=feddyn", *FULL)
    problem, _, reference = prepare(cfg)
    dyn = {E: _final(run_config, "feddyn", E, *FULL) for E in (SOLVED, UNSOLVED)}
    avg = {E: _final(run_config, "fedavg", E, *FULL, rounds=40) for E in (SOLVED, UNSOLVED)}  # at its fixed point
    assert _subopt(problem, dyn[SOLVED]).max() < 1e-10  # measured 0: F(x) rounds to F* in float64
    assert _subopt(problem, avg[SOLVED]).min() > 1e-3  # measured 0.019: FedAvg's heterogeneity bias
    # FedDyn's fixed point is w* at any E (measured 1e-14 apart at E = 5 and 100, 7e-15 from w*); FedAvg's moves
    # with E (0.032 apart)
    assert np.abs(dyn[SOLVED] - dyn[UNSOLVED]).max() < 1e-10
    assert np.abs(dyn[SOLVED] - reference.w_star).max() < 1e-10
    assert np.abs(avg[SOLVED] - avg[UNSOLVED]).max() > 1e-2


def test_feddyn_with_unequal_weights_reaches_the_weighted_optimum_and_keeps_each_clients_gradient(run_config):
    cfg = run_config(*QUADRATIC, "algorithm=feddyn", f"algorithm.local_steps={SOLVED}", *FULL)
    engine, outcome = _run(cfg, 100, UNEQUAL_P)
    problem = engine.problem
    w_star, x = problem.optimum(), outcome.state.x.numpy()
    assert np.linalg.norm(w_star - prepare(cfg)[0].optimum()) > 0.5  # the weights move the optimum (0.84 here)
    assert _subopt(problem, x).max() < 1e-10  # measured -4e-16: F(x) rounds to F*
    assert np.abs(x - w_star).max() < 1e-10  # measured 3e-13
    unsolved = _final(run_config, "feddyn", UNSOLVED, *FULL, rounds=100, weights=UNEQUAL_P)
    assert np.abs(unsolved - x).max() < 1e-10  # the same fixed point at E = 5 (measured 4e-14 apart)
    fedavg = _final(run_config, "fedavg", SOLVED, *FULL, rounds=40, weights=UNEQUAL_P)
    assert _subopt(problem, fedavg).min() > 1e-3  # FedAvg (q_k = p_k) with the same E: measured 0.024
    # g_k is kept by the recursion g_k <- g_k - alpha (w_k - w), never recomputed; at the fixed point it is
    # grad L_k(w*) = N p_k A_k (w* - e_k) (measured within 5e-12)
    kept = engine.executor.shards[0].get_state()
    grads = 6 * UNEQUAL_P[:, None] * np.einsum("kde,ke->kd", problem.A_np, w_star[None] - problem.e_np)
    for (replica, k), slots in kept.items():
        np.testing.assert_allclose(slots["feddyn_grad"].numpy(), grads[k], rtol=0, atol=1e-10)
    assert len(kept) == 6


def test_feddyn_with_partial_participation_goes_below_fedavgs_floor(run_config):
    def subopts(name: str, rounds: int) -> np.ndarray:
        cfg = run_config(*QUADRATIC, f"algorithm={name}", f"algorithm.local_steps={SOLVED}", *PARTIAL)
        _, outcome = _run(cfg, rounds, eval_every=5)
        return np.array([[r["round"], r["subopt"]] for r in outcome.rows])

    dyn, avg = subopts("feddyn", 100), subopts("fedavg", 60)
    assert dyn[dyn[:, 0] == 100, 1].max() < 1e-10  # both replicas; measured 9e-16
    assert avg[avg[:, 0] >= 20, 1].min() > 1e-3  # FedAvg's floor from round 20 to 60: measured 0.18


def test_h_is_the_mean_of_every_clients_g_k(run_config):
    # h starts at 0 and each round subtracts alpha (1/N) sum_P Delta_k, which is what the clients' g_k lose: so
    # h = (1/N) sum_k g_k over all N clients (those not yet sampled hold 0). Both sides add the same alpha Delta_k
    # terms in another grouping and order: 7 rounds of float64 rounding, far below 1e-12 of |h| ~ 1.
    cfg = run_config(*QUADRATIC, "algorithm=feddyn", f"algorithm.local_steps={UNSOLVED}", *PARTIAL)
    engine, outcome = _run(cfg, 7, UNEQUAL_P)
    kept = engine.executor.shards[0].get_state()
    for r in range(2):
        mean = sum(s["feddyn_grad"] for (replica, _), s in kept.items() if replica == r) / 6
        torch.testing.assert_close(outcome.state.server_state["h"][r], mean, rtol=1e-12, atol=1e-12)
        assert mean.abs().max() > 1e-2
    assert len(kept) > 6  # both replicas' clients


# --- the same rows wherever the clients train ----------------------------------------------------------------

# Synthetic(1,1): clients of unequal sizes, so p_k differs and the N p_k scaling is exercised
RUN = ["dataset=synthetic", "dataset.num_clients=12", "dataset.data_seed=0", "algorithm=feddyn", "dtype=float64",
       "replicas=2", "algorithm.clients_per_round=4", "algorithm.local_steps=3",
       "algorithm.feddyn_alpha=0.1", "rounds=6", "eval_every=1", "reference=off", "heterogeneity=false",
       "progress=false", "threads=1"]
METRICS = ("train_loss", "grad_norm_sq", "test_loss", "test_acc", "tau_eff", "chi2", "bytes_up")


def _rows(results, run_id: str) -> list[tuple]:
    return [(r["round"], r["replica"], *(r[m] for m in METRICS)) for r in read_rounds(results, run_id)]


def test_the_same_rows_on_1_and_3_shards_resumed_and_in_a_batch(tmp_path):
    execute(load_settings([f"results_dir={tmp_path / 'one'}", *RUN]), run_id="one")
    want = _rows(tmp_path / "one", "one")
    assert len(want) == 14 and want[-1][2] < want[0][2]  # rounds 0..6 of 2 replicas; the loss went down
    execute(load_settings([f"results_dir={tmp_path / 'three'}", *RUN, "num_shards=3"]), run_id="three")
    assert _rows(tmp_path / "three", "three") == want

    cut = tmp_path / "cut"
    with pytest.raises(RuntimeError, match="crashed at round 5"):
        execute(load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=2"]), run_id="victim",
                callbacks=[CrashAt(5)])
    execute(load_settings([f"results_dir={cut}", *RUN, "checkpoint_every=2", "num_shards=3", "resume=victim"]))
    assert _rows(cut, "victim") == want  # h from the run state, each g_k from its shard's checkpoint files

    batch = tmp_path / "batch"
    slots = [Slot(load_settings([f"results_dir={batch}", *RUN, *extra]), run_id)
             for run_id, extra in (("a", []), ("b", ["algorithm.client_lr=0.02", "algorithm.local_steps=4"]))]
    assert [r.status for r in execute_batch(slots)] == ["ok", "ok"]
    alone = tmp_path / "alone"
    execute(load_settings([f"results_dir={alone}", *RUN, "algorithm.client_lr=0.02", "algorithm.local_steps=4"]),
            run_id="b")
    for got, expected in ((_rows(batch, "a"), want), (_rows(batch, "b"), _rows(alone, "b"))):
        assert [[v is None for v in g] for g in got] == [[v is None for v in e] for e in expected]  # round 0: no tau_eff
        # a batch trains its slots' copies together, in other groupings than alone: float64 rounding apart
        np.testing.assert_allclose(np.array(got, dtype=np.float64), np.array(expected, dtype=np.float64), rtol=1e-12,
                                   atol=0, equal_nan=True)


@pytest.mark.slow
def test_the_same_rows_on_ray(local_ray, tmp_path):
    execute(load_settings([f"results_dir={tmp_path / 'inline'}", *RUN]), run_id="inline")
    execute(load_settings([f"results_dir={tmp_path / 'ray'}", *RUN, "executor=ray", "ray.num_shards=2",
                           "checkpoint_every=2"]), run_id="ray")
    assert _rows(tmp_path / "ray", "ray") == _rows(tmp_path / "inline", "inline")


# --- combinations outside the paper ------------------------------------------------------------------------

@pytest.mark.parametrize("override, key", [
    ("algorithm.aggregator=median", "algorithm.aggregator"),  # a robust rule would replace the plain mean
    ("algorithm.server_optimizer=adam", "algorithm.server_optimizer"),
    ("algorithm.sampler=poisson", "algorithm.sampler"),  # |P_t| would vary from round to round
    ("algorithm.dropout=0.2", "algorithm.dropout"),
    ("cadence.deadline_s=2", "cadence.deadline_s"),
])
def test_combinations_outside_the_paper_are_refused_in_one_line(override, key, tmp_path, capsys):
    results = tmp_path / "results"
    assert cli.main(["run", f"results_dir={results}", *RUN, override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{key}'" in err and "feddyn" in err
    assert not results.exists()
