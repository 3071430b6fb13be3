"""The problem and the algorithm a config describes. The driver and every Ray shard build them here, alike."""

from __future__ import annotations

from fedharness.algorithms.registry import build_algorithm
from fedharness.algorithms.attacks import LabelFlip
from fedharness.config.schema import check_data_clients
from fedharness.contracts import Attack, Labelled, UpdateAggregator
from fedharness.core.byzantine import Adversary
from fedharness.core.executors import require_fits_budget
from fedharness.errors import require
from fedharness.extend import register_targets
from fedharness.registry.plugins import load_entry_points
from fedharness.problems import build_problem
from fedharness.registry.groups import ATTACKS, PARTS
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


def adversary_for(settings: RunSettings, algorithm, problem) -> Adversary | None:
    """The run's attack and fraction (None: attack=none). An attack forges updates where they meet the aggregator
    (core/byzantine.py), so it needs an aggregator that sees them; label_flip poisons the training instead, so it
    needs labelled data (ConfigError before any file otherwise)."""
    attack = settings.attack
    if attack is None or attack.name == "none":
        return None
    built = ATTACKS.build(attack.name, attack.as_dict(), {})
    require(isinstance(built, Attack), "attack", attack.name,
            "its factory must build an object with forge(own, honest, keys) (fedharness.contracts.Attack)")
    if isinstance(built, LabelFlip):
        require(isinstance(problem, Labelled), "attack", attack.name,
                f"a data set whose clients train on class labels (digits, mnist, ...); dataset "
                f"{settings.dataset.name} has none")
        return Adversary(built, float(attack.fraction), flips_labels=True)
    seeing = [name for name, factory in PARTS["aggregator"].items()
              if isinstance(factory, type) and issubclass(factory, UpdateAggregator)]
    require(isinstance(algorithm.aggregator, UpdateAggregator), "algorithm.aggregator", settings.algorithm.aggregator,
            f"attack={attack.name} replaces the Byzantine clients' updates where they meet the aggregator, so it "
            f"needs one that sees them ({settings.algorithm.aggregator} is summed on the shards): one of "
            f"{', '.join(seeing)} (mean is FedAvg's weighted mean)")
    return Adversary(built, float(attack.fraction))
