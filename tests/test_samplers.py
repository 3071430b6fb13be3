"""Samplers: unbiasedness of Li et al.'s schemes (and the original scheme's bias), weights, duplicates, dropout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedharness import contracts
from fedharness.algorithms import samplers
from fedharness.base import streams
from fedharness.algorithms.registry import build_algorithm
from fedharness.core.engine import Engine
from fedharness.errors import ConfigError
from fedharness.core.executors import ClientShard, InlineExecutor
from fedharness.problems.data import DataProblem
from fedharness.problems.objectives import SoftmaxRegression
from fedharness.runs.execute import prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

N, K, DIM = 8, 3, 3
DRAWS = 40_000  # Monte Carlo draws: one per replica of a single select call


@pytest.fixture(scope="module")
def unbalanced():
    """Unbalanced client weights p (spread over a factor ~20) and fixed client vectors v_k."""
    rng = np.random.default_rng(11)
    p = rng.dirichlet(np.full(N, 0.7))
    p = np.maximum(p, 0.01)
    return p / p.sum(), rng.normal(size=(N, DIM))


def _aggregate(sel: samplers.Selection, v: np.ndarray) -> np.ndarray:
    """sum over the (multi)set of weights * lr_scale * v_k, per draw: [DRAWS, DIM].

    lr_scale enters because a client's update scales with its step size to first order
    (that is how transformed scheme II is unbiased)."""
    return np.einsum("rk,rkd->rd", sel.weights * sel.lr_scale, v[sel.clients])


def _mean_and_se(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return values.mean(0), values.std(0) / np.sqrt(len(values))


@pytest.mark.parametrize("cls", [samplers.SchemeI, samplers.SchemeII, samplers.TransformedSchemeII])
def test_unbiased_schemes(cls, unbalanced):
    p, v = unbalanced
    sel = cls(N, K).select(0, np.arange(DRAWS), 5, p)
    mean, se = _mean_and_se(_aggregate(sel, v))
    target = p @ v
    assert np.all(np.abs(mean - target) < 4 * se), (mean, target, se)


def test_original_scheme_is_biased(unbalanced):
    """E[w] = w_old + (K/N) sum p_k Delta_k: with w_old = 0 and Delta_k = v_k it misses sum p_k v_k."""
    p, v = unbalanced
    sel = samplers.OriginalScheme(N, K).select(0, np.arange(DRAWS), 5, p)
    mean, se = _mean_and_se(_aggregate(sel, v))
    target = p @ v
    assert np.all(np.abs(mean - K / N * target) < 4 * se)  # what it does estimate
    assert np.max(np.abs(mean - target) / se) > 50  # far from the unbiased target


def test_original_scheme_is_weighted_by_p_and_keeps_the_old_model(unbalanced):
    p, _ = unbalanced
    sel = samplers.OriginalScheme(N, K).select(3, np.arange(5), 2, p)
    np.testing.assert_array_equal(sel.weights, p[sel.clients])
    assert np.all(sel.weights.sum(1) < 1)  # the absent clients' share stays on w_old


def test_scheme_ii_weights_are_not_renormalised(unbalanced):
    p, _ = unbalanced
    sel = samplers.SchemeII(N, K).select(0, np.arange(200), 1, p)
    np.testing.assert_allclose(sel.weights, p[sel.clients] * N / K, rtol=1e-15)
    sums = sel.weights.sum(1)
    assert sums.min() < 0.7 and sums.max() > 1.3  # on unbalanced data the total weight is random
    assert all(len(set(row)) == K for row in sel.clients)  # without replacement


def test_transformed_scheme_ii_weights_and_lr(unbalanced):
    p, _ = unbalanced
    sel = samplers.TransformedSchemeII(N, K).select(0, np.arange(50), 1, p)
    np.testing.assert_allclose(sel.weights, 1.0 / K)
    np.testing.assert_allclose(sel.lr_scale, N * p[sel.clients])


def _balanced_problem() -> DataProblem:
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(6 * 40, 5)), rng.integers(0, 3, 6 * 40)
    index = [np.arange(k * 40, (k + 1) * 40) for k in range(6)]
    return DataProblem(SoftmaxRegression((5,), 3, 1e-3), x, y, index, None, None, 4, torch.float64)


def _final_x(run_config, problem, sampler: str, rounds: int = 6, replicas: int = 2) -> torch.Tensor:
    acfg = run_config(f"algorithm.sampler={sampler}", "algorithm.clients_per_round=3", "algorithm.local_steps=5",
                      "algorithm.batch_size=4", "algorithm.client_lr=0.2").algorithm.as_dict()
    algorithm = build_algorithm(acfg, problem)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=rounds, seed=4,
                    replicas=replicas, eval_every=rounds)
    state = engine.initial_state()
    for _ in range(rounds):
        state = engine.step(state)
    return state.x


def test_transformed_scheme_ii_equals_scheme_ii_on_balanced_data(run_config):
    problem = _balanced_problem()
    assert np.allclose(problem.weights, 1 / 6)
    ii = _final_x(run_config, problem, "scheme_ii")
    transformed = _final_x(run_config, problem, "scheme_ii_transformed")
    assert ii.abs().max() > 0.05  # the model moved
    torch.testing.assert_close(transformed, ii, rtol=1e-12, atol=1e-12)


def test_transformed_scheme_ii_differs_on_unbalanced_data(run_config):
    problem = _balanced_problem()
    problem.weights = np.array([0.3, 0.1, 0.1, 0.2, 0.2, 0.1])  # same data, unequal p_k
    ii = _final_x(run_config, problem, "scheme_ii")
    transformed = _final_x(run_config, problem, "scheme_ii_transformed")
    assert (transformed - ii).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["scheme_i", "yang_s1"])
def test_with_replacement_duplicates_are_counted(name, run_config):
    """A client drawn twice trains once, and its delta enters the executor's sum with coefficient 2/K."""
    cfg = run_config("dataset=quadratic", "dataset.num_clients=4", f"algorithm.sampler={name}",
                     "algorithm.clients_per_round=4", "algorithm.local_steps=2", "replicas=30")
    problem, algorithm, _ = prepare(cfg)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=1, seed=0,
                    replicas=30, eval_every=1)
    plan, _ = engine.plan_round(0)
    entries = ClientShard(problem, algorithm.solver, (0, 4)).entries(plan)
    counts = np.stack([np.bincount(row, minlength=4) for row in plan.clients])
    assert counts.max() >= 2  # some replica drew a client more than once
    for r, k, coef in zip(entries.replica, entries.clients, entries.coef):
        assert coef == pytest.approx(counts[r, k] / 4, rel=1e-12)
    assert len(entries.clients) == (counts > 0).sum()  # each distinct (replica, client) trains once


def test_yang_strategies_are_uniform_with_weights_one_over_k(unbalanced):
    p, _ = unbalanced
    s1 = samplers.YangStrategy1(N, K).select(0, np.arange(DRAWS), 1, p)
    s2 = samplers.YangStrategy2(N, K).select(0, np.arange(DRAWS), 1, p)
    for sel in (s1, s2):
        np.testing.assert_array_equal(sel.weights, 1.0 / K)
        np.testing.assert_array_equal(sel.lr_scale, 1.0)
        # every client is drawn K/N times per round on average whatever its p_k (uniform sampling)
        freq = np.bincount(sel.clients.reshape(-1), minlength=N) / DRAWS
        np.testing.assert_allclose(freq, K / N, atol=0.015)
    assert any(len(set(row)) < K for row in s1.clients)  # with replacement: duplicates happen
    assert all(len(set(row)) == K for row in s2.clients)  # without replacement


def test_samplers_depend_only_on_seed_replica_round(unbalanced):
    p, _ = unbalanced
    sampler = samplers.SchemeII(N, K)
    a = sampler.select(1, np.array([0, 1, 2, 3]), 7, p).clients
    b = sampler.select(1, np.array([2, 3]), 7, p).clients
    np.testing.assert_array_equal(a[2:], b)
    assert not np.array_equal(a, sampler.select(1, np.array([0, 1, 2, 3]), 8, p).clients)


# --- dropout ------------------------------------------------------------------------------------

def test_dropout_rescales_survivors_and_keeps_weights_positive(unbalanced):
    p, _ = unbalanced
    base = samplers.SchemeII(N, 5)
    dropped = samplers.Dropout(base, 0.4)
    full = base.select(2, np.arange(500), 3, p)
    sel = dropped.select(2, np.arange(500), 3, p)
    returned = dropped.returned(2, np.arange(500), 3, full.clients)
    assert 0.5 < returned.mean() < 0.7  # about 1 - rate return
    partial = returned.any(1) & ~returned.all(1)
    assert partial.sum() > 100
    assert np.all(sel.weights > 0) and np.all(np.isfinite(sel.weights))
    np.testing.assert_allclose(sel.weights.sum(1), full.weights.sum(1), rtol=1e-12)  # the total is kept
    for r in np.flatnonzero(partial):
        alive = full.clients[r][returned[r]]
        assert set(sel.clients[r]) == set(alive)  # dropped clients are gone
        # each survivor's total weight (summed over its slots) is its weight times the rescaling
        scale = full.weights[r].sum() / full.weights[r][returned[r]].sum()
        for k, w in zip(alive, full.weights[r][returned[r]]):
            assert sel.weights[r][sel.clients[r] == k].sum() == pytest.approx(w * scale, rel=1e-12)
    np.testing.assert_array_equal(sel.active, returned.any(1))


def test_dropout_is_keyed_by_client():
    """A client drawn twice (with replacement) either returns for both draws or for none."""
    d = samplers.Dropout(samplers.SchemeI(4, 6), 0.5)
    clients = samplers.SchemeI(4, 6).select(0, np.arange(300), 1, np.full(4, 0.25)).clients
    returned = d.returned(0, np.arange(300), 1, clients)
    for row, ret in zip(clients, returned):
        for k in set(row):
            assert len(set(ret[row == k])) == 1


def test_round_where_nobody_returns_is_a_no_op(run_config):
    """K = 1 and dropout 0.5: about half the replicas lose their only client; they must not move."""
    settings = run_config("dataset=quadratic", "dataset.num_clients=5", "algorithm.clients_per_round=1",
                          "algorithm.dropout=0.5", "algorithm.local_steps=3", "algorithm.aggregator=fednova",
                          "algorithm.momentum=0.5", "replicas=16", "dtype=float64")
    problem, algorithm, _ = prepare(settings)
    cfg = settings.config  # the plain config, read by key below
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=1, seed=0,
                    replicas=16, eval_every=1)
    state = engine.initial_state()
    x0 = state.x.clone()
    sel = algorithm.sampler.select(0, np.arange(16), 0, problem.weights)
    idle = ~sel.active
    assert 2 <= idle.sum() <= 14
    state = engine.step(state)
    assert torch.all(state.x[torch.as_tensor(idle)] == x0[torch.as_tensor(idle)])
    assert torch.all((state.x[torch.as_tensor(~idle)] - x0[torch.as_tensor(~idle)]).abs().sum(1) > 0)
    assert np.all(state.counters["grad_evals"][idle] == 0)
    assert np.all(state.counters["grad_evals"][~idle] == 3 * cfg["algorithm"]["batch_size"])
    rows = engine.evaluate(state)
    assert all((row["tau_eff"] is None) == idle[row["replica"]] for row in rows)
    assert all(row["chi2"] is not None for row in rows if not idle[row["replica"]])


def test_dropout_run_end_to_end_stays_finite(run_config):
    cfg = run_config("dataset.num_clients=10", "algorithm.clients_per_round=2", "algorithm.dropout=0.6",
                     "algorithm.local_steps=3", "rounds=12", "eval_every=3", "replicas=4")
    problem, algorithm, _ = prepare(cfg)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=12, seed=0,
                    replicas=4, eval_every=3)
    outcome = engine.run()
    assert outcome.status == "ok"
    assert torch.isfinite(outcome.state.x).all()


# --- config errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("override,key", [
    ("algorithm.dropout=1.0", "algorithm.dropout"),
    ("algorithm.dropout=-0.1", "algorithm.dropout"),
    ("algorithm.dropout=often", "algorithm.dropout"),
    ("algorithm.dropout=true", "algorithm.dropout"),
    ("algorithm.clients_per_round=0", "algorithm.clients_per_round"),
    ("algorithm.clients_per_round=2.5", "algorithm.clients_per_round"),
    ("algorithm.sampler=everyone", "algorithm.sampler"),
])
def test_bad_sampler_values_name_the_key(override, key, run_config):
    with pytest.raises(ConfigError) as err:
        prepare(run_config("dataset=quadratic", override))
    assert err.value.key == key


@pytest.mark.parametrize("name", ["scheme_ii", "scheme_ii_transformed", "original", "yang_s2"])
def test_without_replacement_needs_k_at_most_n(name, run_config):
    with pytest.raises(ConfigError) as err:
        prepare(run_config("dataset=quadratic", "dataset.num_clients=4", f"algorithm.sampler={name}",
                           "algorithm.clients_per_round=5"))
    assert err.value.key == "algorithm.clients_per_round"


# --- Poisson sampling (DP-FedAvg's): rate exactly K / N (issue 35) -------------------------------------------

def test_poisson_sampling_with_k_equal_to_n_takes_every_client_every_round():
    """q = K / N = 1: every client in every replica and round (the uniforms are below 1), each weighing 1 / K."""
    sampler = samplers.PoissonSampling(20, 20)
    for rnd in range(50):
        sel = sampler.select(4, np.arange(8), rnd, np.full(20, 1 / 20))
        np.testing.assert_array_equal(sel.clients, np.broadcast_to(np.arange(20), (8, 20)))
        np.testing.assert_array_equal(sel.weights, 1 / 20)
        assert sel.active.all()


def test_poisson_sampling_is_unbiased_for_the_clients_plain_mean_at_rate_k_over_n(unbalanced):
    """Each client taken with probability q = K / N and weighed 1 / K: E[sum w_k v_k] = mean_k v_k whatever p (the
    fixed-denominator estimator). A rate of K / (N + 1) would miss it by 1 / 9 (here ~30 standard errors)."""
    p, v = unbalanced
    sel = samplers.PoissonSampling(N, K).select(0, np.arange(DRAWS), 5, p)
    mean, se = _mean_and_se(_aggregate(sel, v))
    assert np.all(np.abs(mean - v.mean(0)) < 4 * se), (mean, v.mean(0), se)
    taken = (sel.weights > 0).sum(1)  # Binomial(N, q): 40,000 draws, the mean's standard error 0.007
    assert taken.mean() == pytest.approx(K, abs=4 * np.sqrt(N * K / N * (1 - K / N) / DRAWS))


# --- preferring the online clients (the systems clock: harness/core/clock.py) ------------------------------------

class EveryThirdOffline(contracts.Availability):
    """Clients whose id is a multiple of 3 are offline (at any time); the others online."""

    def online(self, seeds, replicas, t, clients):
        return np.asarray(clients) % 3 != 0


def _online(rows: int) -> contracts.Online:
    return contracts.Online(EveryThirdOffline(), np.zeros(rows, np.int64), np.arange(rows), np.zeros(rows))


def _stream(replicas: np.ndarray, rnd: int, count: int, sub: int = 0) -> np.ndarray:
    return streams.uniform(streams.stream_key(7, streams.SAMPLE, replicas[:, None] if sub else replicas, rnd, sub),
                           count)


def test_samplers_without_replacement_take_the_first_k_online_of_their_draw():
    replicas, K = np.arange(3), 5
    sel = samplers.YangStrategy2(20, K).select(7, replicas, 4, np.full(20, 1 / 20), online=_online(3))
    order = np.argsort(_stream(replicas, 4, 20), axis=1, kind="stable")  # the shuffle of all N
    for r in range(3):
        assert sel.clients[r].tolist() == [int(k) for k in order[r] if k % 3][:K]
    big = 1 << 17  # beyond the shuffle: the first K distinct online clients of a stream of uniform draws
    sel = samplers.YangStrategy2(big, K).select(7, replicas, 4, None, online=_online(3))
    for r in range(3):
        key = streams.stream_key(7, streams.SAMPLE, r, 4, 1)
        draws = streams.integers(key, 64 * K, big)  # counter-based: drawing more extends the same sequence
        want = list(dict.fromkeys(int(k) for k in draws if k % 3))[:K]
        assert sel.clients[r].tolist() == want


def test_samplers_with_replacement_take_the_first_k_online_draws_and_poisson_only_online_clients():
    replicas, K, N = np.arange(3), 6, 12
    sel = samplers.YangStrategy1(N, K).select(7, replicas, 2, np.full(N, 1 / N), online=_online(3))
    u = _stream(replicas, 2, 64 * K)  # the same stream, drawn further for the offline draws it skips
    for r in range(3):
        draws = np.minimum(np.floor(u[r] * N).astype(np.int64), N - 1)
        assert sel.clients[r].tolist() == [int(k) for k in draws if k % 3][:K]
    sel = samplers.PoissonSampling(N, 6).select(7, replicas, 2, np.full(N, 1 / N), online=_online(3))
    taken = _stream(replicas, 2, N) < 6 / N
    for r in range(3):
        assert sel.clients[r][sel.weights[r] > 0].tolist() == [k for k in range(N) if taken[r, k] and k % 3]


def test_too_few_online_fill_the_sample_with_offline_clients_who_then_drop_out():
    sel = samplers.YangStrategy2(6, 5).select(7, np.arange(1), 0, np.full(6, 1 / 6), online=_online(1))
    picked = sel.clients[0].tolist()
    assert sorted(picked[:4]) == [1, 2, 4, 5] and picked[4] % 3 == 0  # the four online first, then one offline


class OnlyMultiplesOnline(contracts.Availability):
    """Only the clients whose id is a multiple of `every` are online."""

    def __init__(self, every: int):
        self.every = every

    def online(self, seeds, replicas, t, clients):
        return np.asarray(clients) % self.every == 0


@pytest.mark.parametrize("every", [20, 5000])
def test_rare_online_clients_are_searched_for_up_to_64_k_draws_then_offline_ones_fill_the_sample(every):
    """1 in 20 online: the K online ones are found (beyond the first 2K draws); 1 in 5,000: the search stops
    after MAX_DRAWS_PER_CLIENT K draws and the sample is the online ones found there, then the offline ones, in the
    order drawn (never fewer than K clients, never a longer search)."""
    K, big, cap = 5, 1 << 17, samplers.MAX_DRAWS_PER_CLIENT * 5
    online = contracts.Online(OnlyMultiplesOnline(every), np.zeros(2, np.int64), np.arange(2), np.zeros(2))
    sel = samplers.YangStrategy2(big, K).select(7, np.arange(2), 4, None, online=online)
    for r in range(2):
        draws = list(dict.fromkeys(int(k) for k in streams.integers(streams.stream_key(7, streams.SAMPLE, r, 4, 1),
                                                                    cap, big)))
        assert sel.clients[r].tolist() == ([k for k in draws if k % every == 0]
                                           + [k for k in draws if k % every])[:K]
    N = 100_000  # with replacement: the same search over the draws of the round's stream
    sel = samplers.YangStrategy1(N, K).select(7, np.arange(2), 4, np.full(N, 1 / N), online=online)
    u = _stream(np.arange(2), 4, cap)
    for r in range(2):
        draws = [int(k) for k in np.minimum(np.floor(u[r] * N).astype(np.int64), N - 1)]
        assert sel.clients[r].tolist() == ([k for k in draws if k % every == 0]
                                           + [k for k in draws if k % every])[:K]
    if every == 20:
        assert (sel.clients % 20 == 0).all()  # found beyond the first 2K draws
