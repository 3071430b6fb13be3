"""Aggregators: the coefficient c_k of each client's delta in Delta = sum_k c_k Delta_k.

Coefficients depend only on the sampling weights and each solver's weighting
vector, both known before training, so the shards can reduce their clients'
deltas themselves and send one partial sum per replica.
"""

from __future__ import annotations

import numpy as np

from fedharness.contracts import Aggregator, Coefficients, WeightStats
from fedharness.registry.groups import part, part_names
from fedharness.keys import Key, choice, number

KEYS: dict[str, Key] = {  # harness/config/schema.py's rules add: tau_eff_value set when tau_eff=fixed
    "aggregator": choice("fedavg | fednova; seeing the updates (algorithms/robust.py): mean | "
                         "median | trimmed_mean | krum | clipped_mean | geometric_median | centered_clip; feddyn "
                         "(FedDyn's plain mean)",
                         part_names("aggregator")),
    "tau_eff": choice("FedNova: steps (sum p tau) | l1 (sum p ||a||_1) | fixed", ("steps", "l1", "fixed")),
    "tau_eff_value": number("tau_eff=fixed: its value", lo=0, lo_open=True, null="not fixed"),
}


def _target_weights(q: np.ndarray, stats: WeightStats) -> np.ndarray:
    """The weights p_k the round should give each client's objective: q_k s_k, normalized.

    s_k is the client's lr multiplier: transformed scheme II (q = 1/K, s = N p_k) targets p_k
    on the sample, exactly as scheme II (q = p N / K, s = 1) does.
    """
    t = q if stats.scale is None else q * stats.scale
    with np.errstate(invalid="ignore"):  # a replica that sampled nobody (poisson): NaN, idled by the engine
        return t / t.sum(1, keepdims=True)


def _diagnostics(p: np.ndarray, coef: np.ndarray, stats: WeightStats, tau: np.ndarray, tau_eff: np.ndarray):
    """Wang et al.'s chi^2(p || w) of the surrogate weights w_k ∝ c_k s_k ||a_k||_1, and slowdown tau_bar / tau_eff.

    tau_bar is the plain mean of the sampled clients' local steps (Wang et al. Thm 1: (1/m) sum tau_i).
    """
    eff = coef * stats.l1 if stats.scale is None else coef * stats.scale * stats.l1
    with np.errstate(invalid="ignore"):
        w = eff / eff.sum(1, keepdims=True)
    # a weight-0 entry (poisson's padding: p = w = 0) adds nothing
    chi2 = np.divide((p - w) ** 2, w, out=np.zeros_like(w), where=w > 0).sum(1)
    return chi2, tau.mean(1) / tau_eff


@part("aggregator", "fedavg")
class WeightedAverage(Aggregator):
    """FedAvg: Delta = sum_k q_k Delta_k. tau_eff = sum_k p_k ||a_k||_1 is its implicit step count (Wang et al.)."""

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        p = _target_weights(q, stats)
        tau_eff = (p * stats.l1).sum(1)
        chi2, slowdown = _diagnostics(p, q, stats, tau, tau_eff)
        return Coefficients(q, tau_eff, chi2, slowdown)


@part("aggregator", "fednova")
class NormalizedAverage(Aggregator):
    """FedNova: Delta = tau_eff * sum_k q_k Delta_k / ||a_k||_1, so the surrogate weights are p_k exactly."""

    def __init__(self, tau_eff: str = "steps", tau_eff_value: float | None = None):
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


@part("aggregator", "feddyn")
class PlainMean(Aggregator):
    """FedDyn's server mean (Acar et al., Algorithm 1): Delta = (1/|P_t|) sum_{k in P_t} Delta_k, the plain mean of
    the models of the |P_t| clients that returned, whatever their p_k (each f_k is scaled by N p_k instead:
    FedDynSGD). Each returned draw is one client: FedDyn's samplers draw without replacement
    (harness/config/schema.py feddyn_composes). tau_eff = sum_k c_k ||a_k||_1."""

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        returned = (q != 0).astype(np.float64)
        with np.errstate(invalid="ignore"):  # a replica nobody returned to: NaN, idled by the engine
            coef = returned / returned.sum(1, keepdims=True)
        tau_eff = (coef * stats.l1).sum(1)
        chi2, slowdown = _diagnostics(coef, coef, stats, tau, tau_eff)
        return Coefficients(coef, tau_eff, chi2, slowdown)
