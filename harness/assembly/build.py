"""The problem and the algorithm a config describes. The driver and every Ray shard build them here, alike."""

from __future__ import annotations

from fedharness.algorithms.registry import build_algorithm
from fedharness.config.schema import check_data_clients
from fedharness.core.executors import require_fits_budget
from fedharness.extend import register_targets
from fedharness.registry.plugins import load_entry_points
from fedharness.problems import build_problem
from fedharness.settings import RunSettings


def algorithm_for(settings: RunSettings, problem):
    return build_algorithm({**settings.algorithm.as_dict(), "rounds": settings.rounds}, problem)  # schedules: rounds


def build_parts(settings: RunSettings):
    """Problem and algorithm of the settings; Ray shards call this too, so they build exactly what the driver has."""
    load_entry_points()  # installed packages' parts, also in a fresh Ray worker
    register_targets(settings.config)  # a user's `_target_` parts, also in a fresh Ray worker
    problem = build_problem(settings, settings.algorithm.batch_size)
    if settings.dataset.num_clients is None:  # every client the data has: now known
        check_data_clients(settings.config, problem.num_clients)
    algorithm = algorithm_for(settings, problem)
    require_fits_budget(problem, algorithm.solver)  # memory_budget_gb, before any reference solve or file
    return problem, algorithm
