"""The geometric median (RFA), centered clipping and bucketing (algorithms/robust.py) against numpy, and the same
models at any shard split with bucketing's draws."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from closeness import EPS64
from fedharness.algorithms.robust import CenteredClip, CoordinateMedian, GeometricMedian, Krum, TrimmedMean, WeightedMean
from fedharness.assembly.build import build_parts
from fedharness.base import streams
from fedharness.core.executors import InlineExecutor
from ray_support import max_rel_diff, trajectory

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def np_geometric_median(u: np.ndarray, w: np.ndarray, iters: int, nu: float) -> np.ndarray:
    a = w / w.sum()
    v = a @ u
    for _ in range(iters):
        beta = a / np.maximum(nu, np.linalg.norm(u - v, axis=1))
        v = beta @ u / beta.sum()
    return v


def np_centered_clip(u: np.ndarray, tau: float, iters: int) -> np.ndarray:
    v = np.median(u, axis=0)
    for _ in range(iters):
        z = u - v
        v = v + (z * np.minimum(1.0, tau / np.linalg.norm(z, axis=1))[:, None]).mean(0)
    return v


def np_buckets(u: np.ndarray, w: np.ndarray, size: int, key) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(streams.uniform(key, len(u)), kind="stable")
    groups = [order[i:i + size] for i in range(0, len(u), size)]
    return (np.stack([w[g] @ u[g] / w[g].sum() for g in groups]), np.array([w[g].sum() for g in groups]))


def np_bucket_rounding(u: np.ndarray, w: np.ndarray, size: int, key) -> np.ndarray:
    """[buckets, dim]: a bound on the rounding of one computation of the bucket means, q = sum_i w_i u_i / sum_i w_i
    over s = size rows. The numerator is within s eps sum|w_i u_i| =: s eps A of its exact value, the positive
    denominator D within s eps D, the division adds eps/2 |q|; with |q| <= A / D that is (2 s + 1) eps A / D."""
    order = np.argsort(streams.uniform(key, len(u)), kind="stable")
    groups = [order[i:i + size] for i in range(0, len(u), size)]
    return np.stack([(2 * len(g) + 1) * EPS64 * (w[g] @ np.abs(u[g])) / w[g].sum() for g in groups])


def np_krum_scores(x: np.ndarray, f: int) -> np.ndarray:
    """Krum's scores by direct differences (the product uses a Gram matrix): each row's squared distances to its
    n - f - 2 nearest others (at least 1), summed."""
    near = min(max(1, len(x) - f - 2), len(x) - 1)
    dist = ((x[:, None] - x[None]) ** 2).sum(-1)
    np.fill_diagonal(dist, np.inf)
    return np.sort(dist, axis=1)[:, :near].sum(1)


def krum_score_rounding(x: np.ndarray, slack: np.ndarray, f: int) -> np.ndarray:
    """A bound on how far a score of rows x can move when each row moves by up to `slack` per coordinate and the
    scores are computed another way. A squared distance d_ij = ||x_i - x_j||^2 moves by at most
    2 ||x_i - x_j|| e + e^2 with e = ||slack_i|| + ||slack_j||; computing it rounds by at most (2 dim + 4) eps
    (||x_i||^2 + ||x_j||^2) (Gram form: ||x_i||^2, ||x_j||^2 and x_i . x_j each a sum of dim products, the last
    within dim eps (||x_i||^2 + ||x_j||^2) / 2, then two additions; the direct form is within that too), once
    for each of the two ways. A sum of the `near` smallest distances moves by at most near times the largest
    move in its row, plus near eps times itself for its own additions."""
    near = min(max(1, len(x) - f - 2), len(x) - 1)
    e = np.linalg.norm(slack, axis=1)
    e = e[:, None] + e[None]
    sq = (x ** 2).sum(1)
    d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
    move = 2 * d * e + e ** 2 + 2 * (2 * x.shape[1] + 4) * EPS64 * (sq[:, None] + sq[None])
    np.fill_diagonal(move, 0)
    return near * move.max(1) + near * EPS64 * np_krum_scores(x, f)


def updates(n: int = 9, dim: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, dim)), rng.uniform(0.5, 2.0, n)


def test_geometric_median_is_the_weiszfeld_iterate_and_minimizes_the_distances():
    u, w = updates()
    got = GeometricMedian(rfa_iters=5).aggregate(torch.tensor(u), torch.tensor(w)).numpy()
    want = np_geometric_median(u, w, 5, 1e-6)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
    # converged, it is the minimizer of sum_k a_k ||v - u_k|| (scipy from the mean, to its tolerance)
    v = GeometricMedian(rfa_iters=500).aggregate(torch.tensor(u), torch.tensor(w)).numpy()
    cost = lambda x: w @ np.linalg.norm(u - x, axis=1)  # noqa: E731
    best = minimize(cost, u.mean(0), method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-12,
                                                                       "maxiter": 40_000, "maxfev": 40_000})
    assert cost(v) <= best.fun * (1 + 1e-9)
    assert np.linalg.norm(v - best.x) < 1e-3 * np.linalg.norm(best.x)


def test_geometric_median_and_centered_clip_ignore_far_outliers():
    u, w = updates(n=10)
    bad = u.copy()
    bad[:3] = 1e6  # three of ten far away
    mean = WeightedMean().aggregate(torch.tensor(bad), torch.ones(10)).numpy()
    honest = u[3:].mean(0)
    for rule in (GeometricMedian(rfa_iters=50), CenteredClip(cc_tau=1.0, cc_iters=3)):
        got = rule.aggregate(torch.tensor(bad), torch.ones(10, dtype=torch.float64)).numpy()
        assert np.linalg.norm(got - honest) < 2.0 and np.linalg.norm(mean - honest) > 1e5


def test_centered_clip_is_karimireddys_iteration_from_the_median():
    u, w = updates()
    for tau in (0.5, 100.0):
        got = CenteredClip(cc_tau=tau, cc_iters=4).aggregate(torch.tensor(u), torch.tensor(w)).numpy()
        want = np_centered_clip(u, tau, 4)
        assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
    # a radius no update reaches: one step from the median lands on the plain mean
    far = CenteredClip(cc_tau=1e9, cc_iters=1).aggregate(torch.tensor(u), torch.tensor(w)).numpy()
    assert np.abs(far - u.mean(0)).max() < 1e-12


@pytest.mark.parametrize("rule", ["geometric_median", "centered_clip"])
@pytest.mark.parametrize("n,size", [(9, 2), (10, 3), (5, 1)])
def test_bucketing_averages_random_buckets_first(rule, n, size):
    u, w = updates(n=n)
    key = streams.stream_key(4, streams.BUCKETS, 1, 7, 0)
    agg = (GeometricMedian(rfa_iters=6, bucket_size=size) if rule == "geometric_median" else
           CenteredClip(cc_tau=0.7, cc_iters=2, bucket_size=size))
    got = agg.aggregate_keyed(torch.tensor(u), torch.tensor(w), key).numpy()
    bu, bw = np_buckets(u, w, size, key)
    assert len(bu) == -(-n // size)
    want = np_geometric_median(bu, bw, 6, 1e-6) if rule == "geometric_median" else np_centered_clip(bu, 0.7, 2)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
    if size > 1:  # another round's key, other buckets
        other = agg.aggregate_keyed(torch.tensor(u), torch.tensor(w), streams.stream_key(4, streams.BUCKETS, 1, 8, 0))
        assert np.abs(other.numpy() - got).max() > 1e-6


@pytest.mark.parametrize("n", [9, 10])
def test_bucketing_serves_the_median_trimmed_mean_and_krum(n):
    u, w = updates(n=n)
    key = streams.stream_key(2, streams.BUCKETS, 0, 3, 0)
    bu, _ = np_buckets(u, w, 2, key)
    # the product's bucket means and numpy's (w[g] @ u[g] goes to OpenBLAS, whose kernel depends on the CPU) are
    # each within np_bucket_rounding of the exact ones, so within `slack` of each other, never the same bits
    slack = 2 * np_bucket_rounding(u, w, 2, key)
    # an order statistic of a column moves no more than the column's entries do: by at most its largest slack;
    # the mean of the two middle ones (an even count) and of the trimmed ones rounds too (mean_rounding, twice)
    moves, top = slack.max(0), np.abs(bu).max(0)
    got = CoordinateMedian(bucket_size=2).aggregate_keyed(torch.tensor(u), torch.tensor(w), key).numpy()
    assert np.all(np.abs(got - np.median(bu, axis=0)) <= moves + 2 * 3 * EPS64 * top)
    cut = int(0.2 * len(bu))
    kept = len(bu) - 2 * cut
    trimmed = np.sort(bu, axis=0)[cut:len(bu) - cut].mean(0)
    got = TrimmedMean(trim=0.2, bucket_size=2).aggregate_keyed(torch.tensor(u), torch.tensor(w), key).numpy()
    assert np.all(np.abs(got - trimmed) <= moves + 2 * (kept + 1) * EPS64 * top)
    got = Krum(byzantine=1, bucket_size=2).aggregate_keyed(torch.tensor(u), torch.tensor(w), key).numpy()
    # Krum picks one bucket mean: the one numpy's own scores pick, clear of a tie within the scores' rounding
    scores, moved = np_krum_scores(bu, 1), krum_score_rounding(bu, slack, 1)
    best = int(np.argmin(scores))
    assert np.all(np.delete(scores - moved, best) > scores[best] + moved[best])  # no other bucket within rounding
    assert np.all(np.abs(got - bu[best]) <= slack[best])
    assert len(bu) == -(-n // 2)


BASE = ["dataset.num_clients=12", "dataset.samples_per_client=30", "dtype=float64", "replicas=2",
        "algorithm.batch_size=10", "algorithm.local_steps=3", "algorithm.clients_per_round=10",
        "algorithm.client_lr=0.1", "heterogeneity=false", "seed=1"]


@pytest.mark.parametrize("algorithm", ["fedavg_rfa", "fedavg_cclip", "fedavg_krum"])
def test_bucketed_rules_give_the_same_models_at_any_shard_split(run_config, algorithm):
    cfg = run_config(*BASE, f"algorithm={algorithm}", "algorithm.bucket_size=3")
    problem, alg = build_parts(cfg)
    one, _ = trajectory(cfg, InlineExecutor(problem, alg.solver, 1), 3, problem, alg)
    three, _ = trajectory(cfg, InlineExecutor(problem, alg.solver, 3), 3, problem, alg)
    assert (one[-1] - one[0]).norm() > 1e-3 * one[0].norm()
    assert max_rel_diff(three, one) == 0


def test_the_robustness_table_holds_each_rules_mean_and_spread_over_seeds(tmp_path):
    """conf/table/robustness.yaml: its table.md that of today's harness/studies/robustness.py from the same runs
    (tests/table_md/robustness.md), the cells the runs' own final accuracies."""
    import fedharness
    from fedharness.studies import tables

    small = [f"results_dir={tmp_path / 'res'}", "progress=false", *BASE, "partition=iid", "dataset=blobs",
             "rounds=2", "replicas=3", "algorithm=fedavg_median"]
    fedharness.run(small)
    runs = fedharness.run([*small, "attack=sign_flip", "attack.fraction=0.2", "algorithm=fedavg_cclip"])
    fedharness.run([*small, "partition=dirichlet", "attack=gaussian", "attack.fraction=0.1", "algorithm=fedavg_mean"])
    assert tables.main(["robustness", str(tmp_path / "res"), "--out", str(tmp_path / "docs")]) == 0
    table = (tmp_path / "docs" / "table.md").read_text()
    assert (tmp_path / "docs" / "robustness.png").stat().st_size > 0
    assert table == (Path(__file__).parent / "table_md" / "robustness.md").read_text()
    final = runs.rounds[runs.rounds["round"] == 2]["test_acc"] * 100
    row = next(line for line in table.splitlines() if line.startswith("| CC + bucketing"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == f"{final.mean():.1f} ± {final.std():.1f}"  # under sign_flip 20%
    assert "| rule | none | sign_flip 20% | gaussian 10% |" in table and cells[1] == "nan ± nan"  # not run unattacked
