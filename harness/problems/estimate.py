"""The train loss of a population too large to sum over: an unbiased estimate from a uniform sample of clients.

F(w) = sum_k p_k F_k(w) over N clients. With k_1..k_S drawn uniformly with replacement,
N p_k F_k(w) has mean F(w), so

    estimate = mean_s N p_{k_s} F_{k_s}(w),    standard error = std_s(N p_{k_s} F_{k_s}(w), ddof=1) / sqrt(S).

The sample is drawn once per run (a counter-based stream keyed by the run's seed), not per round: every
evaluation and every replica of the run is measured on the same clients, so the train-loss curve moves only
with the model (round-to-round differences carry no resampling noise) and replicas are compared on equal
terms. The standard error is that of one evaluation; the errors of a run's evaluations are correlated.
"""

from __future__ import annotations

import numpy as np

from fedharness.base import streams


def sample_clients(seed: int, num_clients: int, count: int) -> np.ndarray:
    """`count` clients drawn uniformly with replacement from 0..num_clients-1, a pure function of the arguments."""
    key = streams.stream_key(seed, streams.EVAL_SAMPLE, 0, 0, 0)
    return streams.integers(key, count, num_clients)


def weighted_sum_estimate(weights: np.ndarray, values: np.ndarray, num_clients: int) -> tuple[np.ndarray, np.ndarray]:
    """Estimate and standard error of sum_k p_k F_k from a uniform sample: `weights` [S] are the sampled clients'
    p_k, `values` [R, S] their F_k per replica; returns two float64 arrays [R]."""
    terms = num_clients * np.asarray(weights, np.float64) * np.asarray(values, np.float64)
    count = terms.shape[-1]
    se = terms.std(axis=-1, ddof=1) / np.sqrt(count) if count > 1 else np.full(terms.shape[:-1], np.nan)
    return terms.mean(axis=-1), se


# --- stored data: a fixed sample of samples (eval.samples) ----------------------------------------------------------

TRAIN_ROWS, TEST_ROWS = 2, 3  # the EVAL_SAMPLE streams' replica slot: 0 the lazy populations' clients, 1 per-client
AUTO_EXACT_SAMPLES = 100_000  # eval.samples=null: every sample while the training set has at most this many
AUTO_SAMPLES = 10_000  # eval.samples=null, above it: a sample of this many
GRAD_GROUPS = 8  # the sample's gradient is summed in this many groups, for the unbiased squared norm


def sample_rows(seed, count: int, rows: int, split: int = TRAIN_ROWS) -> np.ndarray:
    """`count` rows drawn uniformly with replacement from 0..rows-1, in the order drawn, a pure function of the
    arguments; `seed` an int ([count]) or an array of seeds ([*seeds, count])."""
    key = streams.stream_key(np.asarray(seed), streams.EVAL_SAMPLE, split, 0, 0)
    return streams.integers(key, count, rows)


def mean_estimate(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean over the last axis of values drawn uniformly with replacement, and its standard error
    std(ddof=1) / sqrt(count): float64 arrays of the leading shape."""
    values = np.asarray(values, np.float64)
    return values.mean(-1), values.std(-1, ddof=1) / np.sqrt(values.shape[-1])


def squared_norm_estimate(group_sums: list, group_sizes: list[int]) -> np.ndarray:
    """An unbiased estimate of ||mu||^2, mu the mean of i.i.d. vectors g_i, from sums S_a of disjoint groups of
    m_a of them: sum_{a != b} S_a . S_b / sum_{a != b} m_a m_b (E[S_a . S_b] = m_a m_b ||mu||^2 for a != b). The
    plain ||mean g||^2 is biased upward by tr(Cov g) / count; this one is not, and may be negative where ||mu||^2
    is small against that noise. `group_sums`: [R, dim] float64 arrays, at least two groups."""
    total = sum(group_sums)
    cross = (total * total).sum(-1) - sum((s * s).sum(-1) for s in group_sums)
    sizes = np.asarray(group_sizes, np.float64)
    return cross / (sizes.sum() ** 2 - (sizes ** 2).sum())
