"""Byzantine attacks (`attack=NAME`): what the Byzantine clients of a round send (contracts.Attack).

Which clients are Byzantine, and where their forged updates replace theirs, is algorithms/byzantine.py's. Each attack
here but label_flip (which poisons the training data) maps one replica's updates to the Byzantine clients' messages, in float64: `own` [b, dim] their honest
updates, `honest` [h, dim] the round's honest ones, `keys` [b] their stream keys. ALIE and IPM are omniscient
(they read `honest`), as Baruch et al. 2019 and Xie et al. 2020 assume; Blades (Li et al. 2023) implements the same
rules.
"""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import torch

from fedharness.base import streams
from fedharness.contracts import Attack
from fedharness.keys import Key, number
from fedharness.registry.groups import ATTACKS

GAUSSIAN_KEYS: dict[str, Key] = {"noise_std": number("the standard deviation of each coordinate sent", lo=0,
                                                     lo_open=True)}
SCALING_KEYS: dict[str, Key] = {"factor": number("the factor the client's own update is multiplied by "
                                                 "(model replacement boosts by about n / server_lr)")}
ALIE_KEYS: dict[str, Key] = {"z": number("the standard deviations below the honest mean", lo=0,
                                         null="Baruch et al.'s z_max from n and the Byzantine count")}
IPM_KEYS: dict[str, Key] = {"epsilon": number("the Byzantine clients send -epsilon times the honest mean", lo=0,
                                              lo_open=True)}


@ATTACKS.register("label_flip", keys={})
class LabelFlip(Attack):
    """Data poisoning (contracts.DataPoisoning): each Byzantine client trains honestly on its data with every label
    y read as C - 1 - y (C classes) and sends that update (the shards train it on problems/data.py's flipped view)."""

    view = "labels_flipped"
    needs = frozenset({"labels"})

    def view_of(self, problem):
        return problem.labels_flipped()

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        return own  # the poison is in the training; the update goes as trained


@ATTACKS.register("sign_flip", keys={})
class SignFlip(Attack):
    """Each Byzantine client sends its own update negated."""

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        return -own


@ATTACKS.register("gaussian", keys=GAUSSIAN_KEYS)
class GaussianNoise(Attack):
    """Each Byzantine client sends N(0, noise_std^2) in every coordinate, drawn from its own stream."""

    def __init__(self, noise_std: float = 1.0):
        self.noise_std = float(noise_std)

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        z = streams.normal(keys, own.shape[1])
        return self.noise_std * torch.as_tensor(z, dtype=torch.float64, device=own.device)


@ATTACKS.register("scaling", keys=SCALING_KEYS)
class Scaling(Attack):
    """Model replacement (Bagdasaryan et al. 2020): each Byzantine client sends its own update times `factor`."""

    def __init__(self, factor: float = 10.0):
        self.factor = float(factor)

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        return self.factor * own


def alie_z_max(n: int, byzantine: int) -> float:
    """Baruch et al.'s z_max: s = floor(n/2 + 1) - b clients must be won over; z_max = Phi^-1((n - s) / n)."""
    s = n // 2 + 1 - byzantine
    return NormalDist().inv_cdf((n - s) / n)


@ATTACKS.register("alie", keys=ALIE_KEYS)
class ALittleIsEnough(Attack):
    """ALIE (Baruch et al. 2019): every Byzantine client sends mu - z sigma, the honest updates' coordinate-wise mean
    and standard deviation (unbiased, as torch.std and Blades); z: z_max of the round's n and b unless set."""

    def __init__(self, z: float | None = None):
        self.z = z

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        n, b = len(own) + len(honest), len(own)
        z = alie_z_max(n, b) if self.z is None else float(self.z)
        std = honest.std(0) if len(honest) > 1 else torch.zeros_like(honest[0])
        return (honest.mean(0) - z * std).expand(b, -1).clone()


@ATTACKS.register("ipm", keys=IPM_KEYS)
class InnerProductManipulation(Attack):
    """IPM (Xie, Koyejo and Gupta 2020): every Byzantine client sends -epsilon times the honest updates' mean."""

    def __init__(self, epsilon: float = 0.1):
        self.epsilon = float(epsilon)

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        return (-self.epsilon * honest.mean(0)).expand(len(own), -1).clone()
