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

from fedharness.closed_forms import rr_coefficients
from fedharness.core.engine import ReplicaLayout
from fedharness.errors import require

RR_KINDS = ("none", "gamma", "H")


def _burn_in_rounds(burn_in: float, rounds: int) -> int:
    return math.floor(burn_in * rounds)


class PolyakAverage:
    """Running mean of the iterates after round floor(burn_in * rounds); the iterate itself before that."""

    def __init__(self, burn_in: float):
        self.burn_in = burn_in

    def init_state(self, x: torch.Tensor) -> dict:
        return {"sum": torch.zeros(x.shape, dtype=torch.float64, device=x.device), "count": 0, "last": x.clone()}

    def observe(self, hs: dict, x: torch.Tensor, rnd: int, rounds: int) -> None:
        hs["last"] = x.clone()
        if rnd > _burn_in_rounds(self.burn_in, rounds):
            hs["sum"] += x.double()
            hs["count"] += 1

    @staticmethod
    def average(hs: dict) -> torch.Tensor:
        if hs["count"] == 0:
            return hs["last"]
        return (hs["sum"] / hs["count"]).to(hs["last"].dtype)

    def series(self, hs: dict) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
        return {"average": (self.average(hs), np.arange(len(hs["last"])))}


class RichardsonRomberg(PolyakAverage):
    """Average of all 2R replicas, plus the extrapolated iterate and the extrapolated average."""

    def __init__(self, kind: str, replicas: int, local_steps: int, burn_in: float):
        super().__init__(burn_in)
        self.replicas = replicas
        self.a, self.b = rr_coefficients(kind, local_steps)

    def _combine(self, x: torch.Tensor) -> torch.Tensor:
        R = self.replicas
        return (self.a * x[:R].double() + self.b * x[R:].double()).to(x.dtype)

    def series(self, hs: dict) -> dict[str, tuple[torch.Tensor, np.ndarray]]:
        avg = self.average(hs)
        ids = np.arange(self.replicas)
        return {"average": (avg, np.arange(len(avg))), "rr": (self._combine(hs["last"]), ids),
                "rr_average": (self._combine(avg), ids)}


def build_series(acfg: dict[str, Any], replicas: int) -> tuple[ReplicaLayout, list]:
    """The replica layout and series hooks an algorithm config asks for (`rr`, `rr_shared_noise`,
    `burn_in`, `average`); raises ConfigError for bad values."""
    kind = acfg.get("rr", "none")
    require(kind in RR_KINDS, "algorithm.rr", kind, "one of: " + ", ".join(RR_KINDS))
    shared = acfg.get("rr_shared_noise", True)
    require(isinstance(shared, bool), "algorithm.rr_shared_noise", shared, "true or false")
    burn_in = acfg.get("burn_in", 0.5)
    require(isinstance(burn_in, (int, float)) and not isinstance(burn_in, bool) and 0 <= burn_in < 1,
            "algorithm.burn_in", burn_in, "a fraction of the rounds in [0, 1)")
    average = acfg.get("average", False)
    require(isinstance(average, bool), "algorithm.average", average, "true or false")
    if kind == "none":
        return ReplicaLayout.seeds(replicas), [PolyakAverage(burn_in)] if average else []
    local_steps = 1
    if kind == "H":
        require(acfg.get("local_work") == "steps", "algorithm.local_work", acfg.get("local_work"),
                "steps (a fixed H) when algorithm.rr=H: the extrapolation weights depend on H")
        local_steps = acfg["local_steps"]
    base = np.arange(replicas)
    streams = np.concatenate([base, base if shared else base + replicas])
    ones = np.ones(replicas)
    lr_factor = np.concatenate([ones, 2 * ones if kind == "gamma" else ones])
    tau_factor = np.concatenate([ones, 2 * ones if kind == "H" else ones]).astype(np.int64)
    layout = ReplicaLayout(streams, lr_factor, tau_factor, np.concatenate([base, base]))
    return layout, [RichardsonRomberg(kind, replicas, local_steps, burn_in)]
