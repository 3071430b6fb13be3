"""Aggregators: the coefficient c_k of each client's delta in Delta = sum_k c_k Delta_k.

Coefficients depend only on the sampling weights and each solver's weighting
vector, both known before training, so the shards can reduce their clients'
deltas themselves and send one partial sum per replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedharness.algorithms.solvers import WeightStats
from fedharness.errors import require


@dataclass
class Coefficients:
    coef: np.ndarray  # [R, K]
    tau_eff: np.ndarray  # [R]
    chi2: np.ndarray  # [R]: chi^2(p || w) of the sampled weights against the effective ones
    slowdown: np.ndarray  # [R]: mean tau / tau_eff


def _target_weights(q: np.ndarray, stats: WeightStats) -> np.ndarray:
    """The weights p_k the round should give each client's objective: q_k s_k, normalized.

    s_k is the client's lr multiplier: transformed scheme II (q = 1/K, s = N p_k) targets p_k
    on the sample, exactly as scheme II (q = p N / K, s = 1) does.
    """
    t = q if stats.scale is None else q * stats.scale
    return t / t.sum(1, keepdims=True)


def _diagnostics(p: np.ndarray, coef: np.ndarray, stats: WeightStats, tau: np.ndarray, tau_eff: np.ndarray):
    """Wang et al.'s chi^2(p || w) of the surrogate weights w_k ∝ c_k s_k ||a_k||_1, and slowdown tau_bar / tau_eff.

    tau_bar is the plain mean of the sampled clients' local steps (Wang et al. Thm 1: (1/m) sum tau_i).
    """
    eff = coef * stats.l1 if stats.scale is None else coef * stats.scale * stats.l1
    w = eff / eff.sum(1, keepdims=True)
    chi2 = ((p - w) ** 2 / w).sum(1)
    return chi2, tau.mean(1) / tau_eff


class WeightedAverage:
    """FedAvg: Delta = sum_k q_k Delta_k. tau_eff = sum_k p_k ||a_k||_1 is its implicit step count (Wang et al.)."""

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        p = _target_weights(q, stats)
        tau_eff = (p * stats.l1).sum(1)
        chi2, slowdown = _diagnostics(p, q, stats, tau, tau_eff)
        return Coefficients(q, tau_eff, chi2, slowdown)


class NormalizedAverage:
    """FedNova: Delta = tau_eff * sum_k q_k Delta_k / ||a_k||_1, so the surrogate weights are p_k exactly."""

    TAU_EFF = ("steps", "l1", "fixed")

    def __init__(self, tau_eff: str = "steps", tau_eff_value: float | None = None):
        require(tau_eff in self.TAU_EFF, "algorithm.tau_eff", tau_eff, "one of: " + ", ".join(self.TAU_EFF))
        if tau_eff == "fixed":
            require(isinstance(tau_eff_value, (int, float)) and not isinstance(tau_eff_value, bool)
                    and tau_eff_value > 0, "algorithm.tau_eff_value", tau_eff_value,
                    "a number > 0 when algorithm.tau_eff=fixed")
        self.tau_eff, self.tau_eff_value = tau_eff, tau_eff_value

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        p = _target_weights(q, stats)
        if self.tau_eff == "steps":
            tau_eff = (p * tau).sum(1)
        elif self.tau_eff == "l1":
            tau_eff = (p * stats.l1).sum(1)
        else:
            tau_eff = np.full(len(q), float(self.tau_eff_value))
        coef = q * tau_eff[:, None] / stats.l1
        chi2, slowdown = _diagnostics(p, coef, stats, tau, tau_eff)
        return Coefficients(coef, tau_eff, chi2, slowdown)
