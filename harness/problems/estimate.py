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
