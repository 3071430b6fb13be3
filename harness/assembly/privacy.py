"""A DP run's mechanism from its settings: dp.target_epsilon calibrated into the noise multiplier before the run
starts, and the server side of DP-FedAvg (algorithms/privacy.py) the engine applies."""

from __future__ import annotations

import dataclasses

from fedharness.algorithms import accounting
from fedharness.algorithms.privacy import DPFedAvg
from fedharness.errors import require
from fedharness.settings import RunSettings


def sampling_rate(settings: RunSettings) -> float:
    """q = K / N of the poisson sampler."""
    return settings.algorithm.clients_per_round / settings.dataset.num_clients


def calibrated(settings: RunSettings) -> RunSettings:
    """The settings with dp.noise_multiplier set to the z at which the run's rounds reach dp.target_epsilon (its
    sampling rate and dp.delta, by dp.accountant); unchanged without a target. The run records the z it used."""
    dp = settings.dp
    if dp.target_epsilon is None or dp.noise_multiplier is not None:
        return settings
    z = accounting.calibrate(dp.accountant, sampling_rate(settings), settings.rounds, dp.delta, dp.target_epsilon)
    return settings.replace(dp=dataclasses.replace(dp, noise_multiplier=z))


def privacy_for(settings: RunSettings, problem) -> DPFedAvg | None:
    """The mechanism of calibrated settings (None: no DP)."""
    dp = settings.dp
    if not dp.enabled:
        return None
    require(problem.num_clients == settings.dataset.num_clients, "dp.noise_multiplier", dp.noise_multiplier,
            f"DP needs a data set with dataset.num_clients clients (this one has {problem.num_clients})")
    mechanism = DPFedAvg(dp.noise_multiplier, dp.clip_norm, settings.algorithm.clients_per_round,
                         sampling_rate(settings), dp.delta, dp.accountant, dp.adaptive, dp.target_quantile, dp.clip_lr,
                         dp.count_noise_multiplier)
    sigma_b = mechanism.count_noise
    require(not dp.adaptive or 2 * sigma_b > dp.noise_multiplier, "dp.count_noise_multiplier",
            dp.count_noise_multiplier, f"> half the noise multiplier ({dp.noise_multiplier:g} / 2) with adaptive "
            f"clipping, or null: max(clients_per_round / 20, z)")
    return mechanism
