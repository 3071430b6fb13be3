"""Data seeds chosen by the size statistics alone: the seeds of Synthetic(alpha, beta) whose client sizes come
closest to Li et al.'s Table 2, found before any training; and the same for the power-law unbalanced split of
MNIST (the digits at the smoke scale), whose sizes the `powerlaw` partition draws from the data seed.

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

from fedharness.partitions.core import powerlaw_sizes
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


# Li et al. Table 2, "MNIST unbalanced": 100 devices, 62,864 training samples, n_k mean 628, std 800, "the number of
# samples among devices follows a power law" (App. D.1; the generator is not in their repository's data scripts).
TABLE2_MNIST_UNBALANCED = SizeStats(devices=100, total=62864, mean=628, std=800)


@dataclass(frozen=True)
class PowerlawSplit:
    """A `powerlaw` partition with drawn sizes (partition.sizes=drawn) of `samples` training samples over
    `devices` clients: what its sizes depend on besides the seed."""

    samples: int
    devices: int
    exponent: float
    min_size: int = 1

    def sizes(self, seed: int) -> np.ndarray:
        return powerlaw_sizes(self.samples, self.devices, seed, exponent=self.exponent, min_size=self.min_size,
                              sizes="drawn")


# li_schemes_mnist's unbalanced split (conf/experiment/li_schemes_mnist.yaml, conf/sweep/repro_li_schemes_mnist.yaml)
# at each scale: the smoke scale's 1,438 training digits (scikit-learn's 8x8 digits after the loader's 80/20 split)
# over 30 devices, the paper scale's 60,000 MNIST training images over 100. Our data sets' totals are fixed, so only
# the spread can be matched: Table 2's std / mean, 800 / 628 = 1.27. Exponent 0.8: of 0.5, 0.6, ..., 1.0, the one
# whose median std / mean over the seeds 0..199 at the smoke scale comes closest to 1.27 (1.20; 0.7 gives 1.00, 0.9
# gives 1.41), chosen from the sizes alone; the paper scale keeps it (median 1.86 over 100 devices) and its seed is
# chosen by the same rule.
LI_MNIST_UNBALANCED = {"smoke": PowerlawSplit(samples=1438, devices=30, exponent=0.8),
                       "paper": PowerlawSplit(samples=60000, devices=100, exponent=0.8)}


def powerlaw_stats(split: PowerlawSplit, seed: int) -> SizeStats:
    """The client sizes n_k of a drawn power-law split with this data seed."""
    n = split.sizes(seed)
    return SizeStats(split.devices, int(n.sum()), float(n.mean()), float(n.std()))


def spread_distance(ours: SizeStats, paper: SizeStats) -> float:
    """The squared log-ratio of std / mean: a split of a data set whose total is fixed can match only its spread."""
    return math.log((ours.std / ours.mean) / (paper.std / paper.mean)) ** 2


def closest_powerlaw_seeds(split: PowerlawSplit, paper: SizeStats = TABLE2_MNIST_UNBALANCED, count: int = DRAWS,
                           searched: int = SEARCHED_SEEDS) -> list[int]:
    """The `count` data seeds among 0..searched-1 whose split's std / mean comes closest to the paper's, best first."""
    distance = {seed: spread_distance(powerlaw_stats(split, seed), paper) for seed in range(searched)}
    return sorted(distance, key=lambda seed: (distance[seed], seed))[:count]


@lru_cache(maxsize=None)
def li_mnist_draws(count: int = DRAWS, scale: str = "smoke") -> list[int]:
    """The data seeds of li_schemes_mnist's draws at a scale: its unbalanced split's closest to Table 2."""
    return closest_powerlaw_seeds(LI_MNIST_UNBALANCED[scale], count=count)


def main() -> int:
    for name, paper in TABLE2.items():
        print(f"{name}: Table 2  N {paper.devices}  total {paper.total}  mean {paper.mean:g}  std {paper.std:g}")
        for seed in closest_seeds(paper):
            s = size_stats(seed, paper.devices)
            print(f"  data_seed {seed:3d}:  N {s.devices}  total {s.total}  mean {s.mean:.0f}  std {s.std:.0f}"
                  f"  distance {size_distance(s, paper):.4f}")
    paper = TABLE2_MNIST_UNBALANCED
    print(f"mnist unbalanced: Table 2  N {paper.devices}  total {paper.total}  mean {paper.mean:g}  std {paper.std:g}"
          f"  std/mean {paper.std / paper.mean:.3f}")
    for scale, split in LI_MNIST_UNBALANCED.items():
        print(f"  {scale}: powerlaw sizes=drawn exponent={split.exponent:g} min_size={split.min_size},"
              f" {split.samples} samples")
        for seed in li_mnist_draws(scale=scale):
            s, n = powerlaw_stats(split, seed), split.sizes(seed)
            print(f"  data_seed {seed:3d}:  N {s.devices}  total {s.total}  mean {s.mean:.0f}  std {s.std:.0f}"
                  f"  std/mean {s.std / s.mean:.3f}  min {n.min()}  max {n.max()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
