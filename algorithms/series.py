"""Extra recorded iterates ("series"): Polyak-Ruppert averages and Richardson-Romberg extrapolation.

A series hook sees every new server model and offers iterates to evaluate beside the
plain ones; the engine records them as their own rows (column `series`), so FedAvg's
iterate, its average and the extrapolated estimates sit side by side in the results.

Richardson-Romberg (Mangold et al.) runs coupled replicas: for R seeds the layout holds
2R replicas, the first R at (gamma, H) and the next R at 2 gamma (rr=gamma) or 2H (rr=H),
sharing their random streams (rr_shared_noise) or not, and starting from the same point.
Replica r of the "rr" series is a theta_r^(1) + b theta_{R+r}^(2); "rr_average" applies the
same weights to the Polyak-Ruppert averages.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fedharness.algorithms.extrapolation import rr_coefficients
from fedharness.contracts import AverageState, LastTwoState, ReplicaLayout, SeriesHook
from fedharness.errors import require
from fedharness.keys import Key, boolean, choice, number

KEYS: dict[str, Key] = {  # the algorithm keys build_series reads
    "average": boolean("also record the Polyak-Ruppert average of the iterates (series average)"),
    "last_two": boolean("also record the average of the last two iterates (series last_two: FedExP's)"),
    "burn_in": number("fraction of the rounds before averaging starts", lo=0, hi=1, hi_open=True),
    "rr": choice("Richardson-Romberg: none | gamma (gamma and 2 gamma) | H (H and 2H)", ("none", "gamma", "H")),
    "rr_shared_noise": boolean("the coupled replicas share their random streams"),
}


def _burn_in_rounds(burn_in: float, rounds: int) -> int:
    return math.floor(burn_in * rounds)


class PolyakAverage(SeriesHook):
    """Running mean of the iterates after round floor(burn_in * rounds); the iterate itself before that."""

    def __init__(self, burn_in: float):
        self.burn_in = burn_in

    def init_state(self, x: torch.Tensor) -> AverageState:
        return {"sum": torch.zeros(x.shape, dtype=torch.float64, device=x.device), "count": 0, "last": x.clone()}

    def observe(self, hs: AverageState, x: torch.Tensor, rnd: int, rounds: int) -> None:
        hs["last"] = x.clone()
        if rnd > _burn_in_rounds(self.burn_in, rounds):
            hs["sum"] += x.double()
            hs["count"] += 1

    @staticmethod
    def average(hs: AverageState) -> torch.Tensor:
        if hs["count"] == 0:
            return hs["last"]
        return (hs["sum"] / hs["count"]).to(hs["last"].dtype)

    def series(self, hs: AverageState) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
        return {"average": (self.average(hs), np.arange(len(hs["last"])))}


class LastTwo(SeriesHook):
    """(x_r + x_{r-1}) / 2, the iterate FedExP reports because its iterates oscillate (Jhunjhunwala et al.,
    Section 5); x_0 itself before the first step."""

    def init_state(self, x: torch.Tensor) -> LastTwoState:
        return {"last": x.clone(), "prev": x.clone()}

    def observe(self, hs: LastTwoState, x: torch.Tensor, rnd: int, rounds: int) -> None:
        hs["prev"], hs["last"] = hs["last"], x.clone()

    def series(self, hs: LastTwoState) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
        mean = ((hs["last"].double() + hs["prev"].double()) / 2).to(hs["last"].dtype)
        return {"last_two": (mean, np.arange(len(mean)))}


class RichardsonRomberg(PolyakAverage):
    """Average of all 2R replicas, plus the extrapolated iterate and the extrapolated average."""

    def __init__(self, kind: str, replicas: int, local_steps: int, burn_in: float):
        super().__init__(burn_in)
        self.replicas = replicas
        self.a, self.b = rr_coefficients(kind, local_steps)

    def _combine(self, x: torch.Tensor) -> torch.Tensor:
        R = self.replicas
        return (self.a * x[:R].double() + self.b * x[R:].double()).to(x.dtype)

    def series(self, hs: AverageState) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
        avg = self.average(hs)
        ids = np.arange(self.replicas)
        return {"average": (avg, np.arange(len(avg))), "rr": (self._combine(hs["last"]), ids),
                "rr_average": (self._combine(avg), ids)}


def build_series(replicas: int, *, rr: str = "none", rr_shared_noise: bool = True, burn_in: float = 0.5,
                 average: bool = False, last_two: bool = False, local_work: str | None = None, local_steps: int = 1,
                 **_other_keys: Any) -> tuple[ReplicaLayout, list]:
    """The replica layout and series hooks the algorithm's keys ask for (`rr`, `rr_shared_noise`, `burn_in`,
    `average`, `last_two`), called with all of them: `build_series(settings.replicas, **settings.algorithm.params)`.
    The schema has checked each key; ConfigError for rr=H without a fixed H."""
    two = [LastTwo()] if last_two else []
    if rr == "none":
        return ReplicaLayout.seeds(replicas), ([PolyakAverage(burn_in)] if average else []) + two
    if rr == "H":
        require(local_work == "steps", "algorithm.local_work", local_work,
                "steps (a fixed H) when algorithm.rr=H: the extrapolation weights depend on H")
    base = np.arange(replicas)
    streams = np.concatenate([base, base if rr_shared_noise else base + replicas])
    ones = np.ones(replicas)
    lr_factor = np.concatenate([ones, 2 * ones if rr == "gamma" else ones])
    tau_factor = np.concatenate([ones, 2 * ones if rr == "H" else ones]).astype(np.int64)
    layout = ReplicaLayout(streams, lr_factor, tau_factor, np.concatenate([base, base]))
    return layout, [RichardsonRomberg(rr, replicas, local_steps if rr == "H" else 1, burn_in)] + two
