"""Aggregators that see the updates (algorithms/robust.py, contracts.UpdateAggregator).

Each built-in rule is checked against a numpy implementation written here, on known arrays and on a run's
round 1 recomputed from each client's own delta; the trajectory is the same with 1 and 3 inline shards, on
the loop executor, in memory-bounded chunks and across 3 Ray shards; the linear aggregators still reduce
in the shards and send no update.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import fedharness
from fedharness.algorithms.registry import PARTS
from fedharness.algorithms.robust import ClippedMean, CoordinateMedian, Krum, TrimmedMean
from fedharness.contracts import UpdateAggregator
from fedharness.base.columns import UNIT, WORKING_BYTES, UpdateColumns
from fedharness.core.engine import Engine
from fedharness.core.updates import aggregate_updates
from fedharness.core.executors import InlineExecutor, LoopExecutor, RoundPlan, entry_bytes
from fedharness.assembly.build import build_parts
from ray_support import max_rel_diff, trajectory

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

# --- the rules, written plainly in numpy --------------------------------------------------------------------


def np_median(u: np.ndarray, w: np.ndarray) -> np.ndarray:
    return np.median(u, axis=0)


def np_trimmed(u: np.ndarray, w: np.ndarray, trim: float) -> np.ndarray:
    n = len(u)
    cut = int(np.floor(trim * n))
    out = np.empty(u.shape[1])
    for j in range(u.shape[1]):
        column = sorted(u[:, j])
        out[j] = np.mean(column[cut:n - cut])
    return out


def np_krum(u: np.ndarray, w: np.ndarray, f: int, m: int) -> np.ndarray:
    """Blanchard et al.; with fewer than f + 3 updates, Flower's max(1, n - f - 2) neighbours."""
    n = len(u)
    scores = []
    for i in range(n):
        d = sorted(float(np.sum((u[i] - u[j]) ** 2)) for j in range(n) if j != i)
        scores.append(sum(d[:max(1, n - f - 2)]))
    best = np.argsort(np.array(scores), kind="stable")[:m]
    return u[best].mean(axis=0)


def np_clipped(u: np.ndarray, w: np.ndarray, clip: float) -> np.ndarray:
    out = np.zeros(u.shape[1])
    for row, weight in zip(u, w):
        norm = np.linalg.norm(row)
        out += weight * (row if norm <= clip else row * clip / norm)
    return out


RULES = {  # config overrides, the part, the numpy rule
    "median": (["algorithm=fedavg_median"], CoordinateMedian(), np_median),
    "trimmed_mean": (["algorithm=fedavg_trimmed_mean", "algorithm.trim=0.2"], TrimmedMean(0.2),
                     lambda u, w: np_trimmed(u, w, 0.2)),
    "krum": (["algorithm=fedavg_krum", "algorithm.byzantine=1", "algorithm.krum_select=2"], Krum(1, 2),
             lambda u, w: np_krum(u, w, 1, 2)),
    "clipped_mean": (["algorithm=fedavg_clipped", "algorithm.clip_norm=0.8"], ClippedMean(0.8),
                     lambda u, w: np_clipped(u, w, 0.8)),
}


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("name", sorted(RULES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_each_rule_equals_numpy_on_known_updates(name, n):
    _, part, rule = RULES[name]
    rng = np.random.default_rng(n)
    u = rng.normal(size=(n, 9)) * 0.1
    if n > 3:
        u[1] += 50.0  # one Byzantine client far away
    w = rng.uniform(0.1, 1.0, n)
    got = part.aggregate(torch.as_tensor(u), torch.as_tensor(w))
    assert got.shape == (9,) and got.dtype == torch.float64
    assert rel(got, rule(u, w)) < 1e-12
    if n == 7 and name != "clipped_mean":  # (n = 4: trim 0.2 cuts nothing)
        assert np.abs(got.numpy()).max() < 1.0  # the robust rules ignore the outlier


def test_multi_krum_averages_the_m_best_scored():
    u = np.array([[0.0, 0.0], [0.1, 0.0], [0.0, 0.2], [5.0, 5.0], [0.3, 0.1], [-4.0, 6.0]])
    got = Krum(1, 3).aggregate(torch.as_tensor(u), torch.ones(6, dtype=torch.float64))
    assert rel(got, u[[0, 1, 2]].mean(axis=0)) < 1e-12  # by hand: scores 0.15, 0.11, 0.19 (row 4: 0.25)
    assert rel(got, np_krum(u, None, 1, 3)) < 1e-12


# --- end to end: round 1 of a run, recomputed from every client's own delta --------------------------------

# 8 clients, 10 draws with replacement: duplicates for sure; dropout re-points dropped draws at survivors (seed 0:
# it drops a client in round 1 and leaves Krum at least 4 clients in every round of these tests).
BASE = ["dataset.num_clients=8", "dataset.samples_per_client=30", "dtype=float64", "replicas=2",
        "algorithm.batch_size=10", "algorithm.local_steps=3", "algorithm.clients_per_round=10",
        "algorithm.client_lr=0.1", "heterogeneity=false", "seed=0", "algorithm.dropout=0.1"]


def client_deltas(problem, algorithm, plan: RoundPlan, x: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """Delta_k of every (replica, client) trained in `plan`, each alone on the slow loop executor through
    the linear path (coefficient 1 for it, 0 for every other draw)."""
    ref = LoopExecutor(problem, algorithm.solver)
    out = {}
    for r, k in sorted({(r, int(k)) for r in range(len(x)) for k, c in zip(plan.clients[r], plan.coef[r]) if c}):
        coef = np.zeros_like(plan.coef)
        coef[r, np.flatnonzero(plan.clients[r] == k)[0]] = 1.0
        alone = RoundPlan(plan.round, plan.seed, plan.stream_replicas, plan.clients, coef, plan.tau,
                          plan.lr_scale, plan.step_lrs)
        out[(r, k)] = ref.local_updates(x, alone).delta[r]
    return out


@pytest.mark.parametrize("name", sorted(RULES))
def test_round_one_equals_numpy_on_each_clients_delta(run_config, name):
    overrides, _, rule = RULES[name]
    cfg = run_config(*overrides, *BASE, "rounds=1")
    problem, algorithm = build_parts(cfg)
    assert isinstance(algorithm.aggregator, UpdateAggregator)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 3), rounds=1, seed=cfg.seed,
                    replicas=cfg.replicas, eval_every=1)
    state = engine.initial_state()
    x0 = state.x.clone()
    plan, _ = engine.plan_round(0)
    deltas = client_deltas(problem, algorithm, plan, x0)
    want = []
    for r in range(cfg.replicas):
        kept = plan.coef[r] != 0
        ids = sorted(set(plan.clients[r][kept].tolist()))
        weights = np.array([plan.coef[r][kept][plan.clients[r][kept] == k].sum() for k in ids])
        assert len(ids) < kept.sum()  # duplicate draws, one row each
        u = np.stack([deltas[(r, k)].numpy() for k in ids])
        want.append(x0[r].numpy() + rule(u, weights))  # server SGD with server_lr 1
    x1 = engine.step(state).x
    _, undropped = build_parts(run_config(*overrides, *BASE, "rounds=1", "algorithm.dropout=0"))
    drawn = undropped.sampler.select(cfg.seed, engine.stream_replicas, 0, problem.weights).clients
    assert sum(len(set(row)) for row in drawn) > sum(len(set(row)) for row in plan.clients)  # dropout took some
    assert rel(x1, np.stack(want)) < 1e-10
    assert rel(x1 - x0, np.stack(want) - x0.numpy()) < 1e-8  # and the step itself, not only x0


# --- the same trajectory whatever the shards, executor or chunks --------------------------------------------

ROUNDS = 4


def _trajectory(cfg, executor_of):
    problem, algorithm = build_parts(cfg)
    xs, _ = trajectory(cfg, executor_of(problem, algorithm), ROUNDS, problem, algorithm)
    return xs, problem, algorithm


@pytest.mark.parametrize("name", sorted(RULES))
def test_one_three_shards_reference_and_chunks_agree(run_config, name):
    cfg = run_config(*RULES[name][0], *BASE)
    one, _, _ = _trajectory(cfg, lambda p, a: InlineExecutor(p, a.solver, 1))
    three, _, _ = _trajectory(cfg, lambda p, a: InlineExecutor(p, a.solver, 3))
    ref, _, _ = _trajectory(cfg, lambda p, a: LoopExecutor(p, a.solver))
    problem, algorithm = build_parts(cfg)
    problem.memory_budget = 2 * entry_bytes(problem, algorithm.solver, 3)  # two client copies a batch
    executor = InlineExecutor(problem, algorithm.solver, 1)
    chunked, _ = trajectory(cfg, executor, ROUNDS, problem, algorithm)
    assert executor.shards[0].chunk_entries(3, 8) == 2
    assert (one[-1] - one[0]).norm() > 1e-3 * one[0].norm()  # the model moved
    assert max_rel_diff(three, one) < 1e-12
    assert max_rel_diff(chunked, one) < 1e-12
    assert max_rel_diff(ref, one) < 1e-9


def test_updates_travel_in_budgeted_chunks_only_for_an_update_aggregator(run_config):
    cfg = run_config(*BASE, "algorithm=fedavg_median")
    problem, algorithm = build_parts(cfg)
    problem.memory_budget = 3 * entry_bytes(problem, algorithm.solver, 3)
    executor = InlineExecutor(problem, algorithm.solver, 2)
    engine = Engine(problem, algorithm, executor, rounds=1, seed=cfg.seed, replicas=cfg.replicas, eval_every=1)
    x = engine.initial_state().x
    plan, _ = engine.plan_round(0)
    result = executor.local_updates(x, plan)
    distinct = sum(len(set(plan.clients[r].tolist())) for r in range(cfg.replicas))
    assert plan.send_updates and sum(len(c.clients) for c in result.updates) == distinct
    assert max(len(c.clients) for c in result.updates) <= 3 and len(result.updates) >= 2
    assert result.delta.abs().max() == 0 and all(c.delta.dtype == problem.dtype for c in result.updates)
    # the linear path: the same round reduced in the shards, no update sent, bit for bit what it was
    linear = RoundPlan(plan.round, plan.seed, plan.stream_replicas, plan.clients, plan.coef, plan.tau,
                       plan.lr_scale, plan.step_lrs)
    assert not linear.send_updates
    reduced = executor.local_updates(x, linear)
    assert reduced.updates == []
    by_client = {(int(r), int(k)): d for c in result.updates for r, k, d in zip(c.replica, c.clients, c.delta)}
    for r in range(cfg.replicas):
        ids, inverse = np.unique(plan.clients[r], return_inverse=True)
        weights = np.bincount(inverse, weights=plan.coef[r])
        want = sum(w * by_client[(r, int(k))].double() for k, w in zip(ids, weights))
        assert rel(reduced.delta[r], want) < 1e-12


# --- the driver's side within memory_budget_gb: coordinate chunks, the same bits ---------------------------------


@pytest.mark.parametrize("name", sorted(RULES))
def test_known_updates_in_chunks_give_the_bits_of_one_chunk(name):
    _, part, rule = RULES[name]
    rng = np.random.default_rng(1)
    u = torch.as_tensor(rng.normal(size=(7, 3 * UNIT + 123)) * 10.0 ** rng.integers(-3, 3, size=(7, 1)))
    u[2] += 50.0  # a Byzantine client far away
    w = torch.as_tensor(rng.uniform(0.1, 1.0, 7))
    whole = part.aggregate(u, w)
    assert rel(whole, rule(u.numpy(), w.numpy())) < 1e-12
    for units in (1, 2, 3):
        rows = list(u.float() if units == 3 else u)  # the model's dtype on the way, float64 in the chunks
        budget = units * UNIT * 7 * WORKING_BYTES
        chunked = part.aggregate_columns(UpdateColumns.within(rows, budget, "cpu"), w)
        assert UpdateColumns.within(rows, budget, "cpu").width == units * UNIT
        want = whole if units < 3 else part.aggregate(u.float().double(), w)
        assert torch.equal(chunked, want), (name, units)


@pytest.mark.parametrize("name", sorted(RULES))
def test_a_budget_below_one_rounds_updates_gives_the_bits_of_no_budget(run_config, name):
    cfg = run_config(*RULES[name][0], *BASE, "model=2nn")
    problem, algorithm = build_parts(cfg)
    problem.memory_budget = None
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 2), rounds=1, seed=cfg.seed,
                    replicas=cfg.replicas, eval_every=1)
    x = engine.initial_state().x
    plan, _ = engine.plan_round(0)
    updates = engine.executor.local_updates(x, plan).updates
    rows = sum(len(c.clients) for c in updates)
    budget = 2 * UNIT * 8 * WORKING_BYTES  # 8 clients or fewer: chunks of 2 units or more of 54,209 coordinates
    assert budget < rows * problem.dim * 8 and problem.dim > 6 * 2 * UNIT  # below one round's float64 updates
    unbounded = aggregate_updates(algorithm.aggregator, plan, updates, x, None)
    bounded = aggregate_updates(algorithm.aggregator, plan, updates, x, budget)
    assert unbounded.abs().max() > 0 and torch.equal(bounded, unbounded)


# --- a user's rule, as docs/extending.md writes it -----------------------------------------------------------

@pytest.fixture
def doc_package(tmp_path, monkeypatch):
    from test_byo import write_example

    write_example(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {kind: dict(reg) for kind, reg in PARTS.items()}
    import mypkg.robust

    yield mypkg.robust
    for kind, reg in PARTS.items():
        reg.clear()
        reg.update(saved[kind])
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


def test_the_documented_user_rule_runs_and_equals_numpy(doc_package, tmp_path):
    rng = np.random.default_rng(0)
    u, w = rng.normal(size=(5, 4)), rng.uniform(0.5, 1.0, 5)
    u[2] *= 100
    part = doc_package.NormFilter(keep=0.6)
    keep = np.argsort(np.linalg.norm(u, axis=1), kind="stable")[:3]
    assert rel(part.aggregate(torch.as_tensor(u), torch.as_tensor(w)), w[keep] @ u[keep] / w[keep].sum()) < 1e-12
    r = fedharness.run(["algorithm.aggregator=norm_filter", "+algorithm.keep=0.5", *BASE, "rounds=4",
                        "eval_every=2", "progress=false", f"results_dir={tmp_path / 'results'}"])
    losses = r.rounds["train_loss"].to_numpy()
    assert r.runs.loc[0, "status"] == "ok" and losses[-1] < losses[0]


# --- across Ray shards ------------------------------------------------------------------------------------------



@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 30 s idle
def test_three_ray_shards_follow_the_inline_trajectory(local_ray, run_config):
    from fedharness.backends.ray_executor import RayExecutor

    for name in ("krum", "trimmed_mean"):
        cfg = run_config(*RULES[name][0], *BASE, "executor=ray", "ray.num_shards=3")
        want, _, _ = _trajectory(cfg, lambda p, a: InlineExecutor(p, a.solver, 1))
        problem, algorithm = build_parts(cfg)
        executor = RayExecutor(cfg, problem, algorithm.solver)
        try:
            got, _ = trajectory(cfg, executor, ROUNDS, problem, algorithm)
        finally:
            executor.close()
        assert (want[-1] - want[0]).norm() > 1e-3 * want[0].norm()
        assert max_rel_diff(got, want) < 1e-12, name
