"""The problem and the algorithm a config describes. The driver and every Ray shard build them here, alike."""

from __future__ import annotations

from typing import Any

from fedharness.algorithms.registry import build_algorithm
from fedharness.core.executors import require_fits_budget
from fedharness.extend import register_targets
from fedharness.problems import build_problem


def algorithm_for(cfg: dict[str, Any], problem):
    return build_algorithm({**cfg["algorithm"], "rounds": cfg["rounds"]}, problem)  # schedules know the rounds


def build_parts(cfg: dict[str, Any]):
    """Problem and algorithm of a config; Ray shards call this too, so they build exactly what the driver has."""
    register_targets(cfg)  # a user's `_target_` parts, also in a fresh Ray worker
    problem = build_problem(cfg, cfg["algorithm"]["batch_size"])
    algorithm = algorithm_for(cfg, problem)
    require_fits_budget(problem, algorithm.solver)  # memory_budget_gb, before any reference solve or file
    return problem, algorithm
