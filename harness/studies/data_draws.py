"""Data seeds chosen by the size statistics alone: the seeds of Synthetic(alpha, beta) whose client sizes come
closest to Li et al.'s Table 2, found before any training.

Our Synthetic(alpha, beta) draws n_k as Sahu et al.'s generator does (FedProx repo, data/synthetic_*/
generate_synthetic.py: `np.random.lognormal(4, 2, NUM_USER).astype(int) + 50`, then the first 90% of a device's
samples for training), from a counter-based stream per data seed. The size of every client depends on the data
seed only (not on alpha or beta), so scanning 200 seeds costs milliseconds.

    python -m fedharness.studies.data_draws          # the 5 closest seeds of each Table 2 data set
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from fedharness.problems.synthetic import train_sizes

SEARCHED_SEEDS = 200  # seeds 0..199 are scanned
DRAWS = 5  # a claim is measured over this many data draws


@dataclass(frozen=True)
class SizeStats:
    """N devices, the total of their training samples, and the mean and standard deviation (ddof = 0) of n_k."""

    devices: int
    total: int
    mean: float
    std: float

    def as_dict(self) -> dict:
        return {"devices": self.devices, "total": self.total, "mean": round(self.mean, 1), "std": round(self.std, 1)}


# Li, Huang, Yang, Wang, Zhang (ICLR 2020), Appendix D.1, Table 2 "Statistics of federated datasets": training
# samples per device (mean, std) of the two Synthetic data sets they generated with Sahu et al.'s code.
TABLE2 = {
    "synthetic(0,0)": SizeStats(devices=100, total=42522, mean=425, std=1372),
    "synthetic(1,1)": SizeStats(devices=100, total=27348, mean=273, std=421),
}


def size_stats(seed: int, devices: int) -> SizeStats:
    """The training-set sizes n_k of a Synthetic(alpha, beta) draw with this data seed (any alpha, beta)."""
    n = train_sizes(seed, np.arange(devices))
    return SizeStats(devices, int(n.sum()), float(n.mean()), float(n.std()))


def size_distance(ours: SizeStats, paper: SizeStats) -> float:
    """Squared log-ratios of total, mean and std summed: 0 for an exact match, symmetric in over- and undershoot
    (the sizes are log-normal, so a factor 2 too many weighs as a factor 2 too few)."""
    return sum(math.log(a / b) ** 2 for a, b in ((ours.total, paper.total), (ours.mean, paper.mean),
                                                  (ours.std, paper.std)))


def closest_seeds(paper: SizeStats, count: int = DRAWS, searched: int = SEARCHED_SEEDS) -> list[int]:
    """The `count` data seeds among 0..searched-1 whose size statistics come closest to the paper's, best first."""
    distance = {seed: size_distance(size_stats(seed, paper.devices), paper) for seed in range(searched)}
    return sorted(distance, key=lambda seed: (distance[seed], seed))[:count]


@lru_cache(maxsize=None)
def table2_draws(count: int = DRAWS) -> dict[str, list[int]]:
    """Each Table 2 data set's closest seeds: {"synthetic(0,0)": [...], "synthetic(1,1)": [...]}."""
    return {name: closest_seeds(paper, count) for name, paper in TABLE2.items()}


def main() -> int:
    for name, paper in TABLE2.items():
        print(f"{name}: Table 2  N {paper.devices}  total {paper.total}  mean {paper.mean:g}  std {paper.std:g}")
        for seed in closest_seeds(paper):
            s = size_stats(seed, paper.devices)
            print(f"  data_seed {seed:3d}:  N {s.devices}  total {s.total}  mean {s.mean:.0f}  std {s.std:.0f}"
                  f"  distance {size_distance(s, paper):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
