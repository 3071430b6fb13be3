"""The registry: every part an algorithm is composed of, by name, and how a config builds it.

A named algorithm (`conf/algorithm/<name>.yaml`) is a choice of these parts and
their settings; `build_algorithm` turns the `algorithm` config into an Algorithm.
"""

from __future__ import annotations

from typing import Any, Callable

from fedharness.algorithms import aggregators, local_work, local_work_fixed, samplers, schedules, server, solvers
from fedharness.core.engine import Algorithm
from fedharness.errors import ConfigError, require

Factory = Callable[[dict[str, Any], Any], Any]

SAMPLERS: dict[str, Factory] = {
    "full": lambda a, p: samplers.FullParticipation(p.num_clients),
    "scheme_i": lambda a, p: samplers.SchemeI(p.num_clients, a["clients_per_round"]),
    "scheme_ii": lambda a, p: samplers.SchemeII(p.num_clients, a["clients_per_round"]),
    "scheme_ii_transformed": lambda a, p: samplers.TransformedSchemeII(p.num_clients, a["clients_per_round"]),
    "original": lambda a, p: samplers.OriginalScheme(p.num_clients, a["clients_per_round"]),
    "yang_s1": lambda a, p: samplers.YangStrategy1(p.num_clients, a["clients_per_round"]),
    "yang_s2": lambda a, p: samplers.YangStrategy2(p.num_clients, a["clients_per_round"]),
}

LOCAL_WORK: dict[str, Factory] = {
    "steps": lambda a, p: local_work.FixedSteps(a["local_steps"]),
    "epochs": lambda a, p: local_work.Epochs(a["local_epochs"]),
    "random_steps": lambda a, p: local_work.RandomSteps(a["steps_low"], a["steps_high"]),
    "random_epochs": lambda a, p: local_work.RandomEpochs(a["epochs_low"], a["epochs_high"]),
    "gaussian_steps": lambda a, p: local_work.ClippedGaussianSteps(a["steps_mean"], a["steps_std"], a["steps_min"],
                                                                   a["steps_max"]),
    "per_client": lambda a, p: local_work_fixed.PerClientSteps(a.get("client_steps"), p.num_clients),
}

SCHEDULES: dict[str, Factory] = {
    "constant": lambda a, p: schedules.Constant(a["client_lr"]),
    "inverse_round": lambda a, p: schedules.InverseRound(a["client_lr"]),
    "inverse_step": lambda a, p: schedules.InverseStep(a["lr_beta"], a["lr_gamma"], a["local_steps"]),
    "li_theory": lambda a, p: schedules.li_theory(p, a["local_steps"]),
    "step_decay": lambda a, p: schedules.StepDecay(a["client_lr"], a["decay_at"], a["decay_factor"], a.get("rounds")),
}

SOLVERS: dict[str, Factory] = {
    "sgd": lambda a, p: solvers.LocalSGD(a["momentum"], a["nesterov"], a["mu"], a["weight_decay"], a["lr_decay"]),
    "scaffold": lambda a, p: solvers.ScaffoldSGD(a["momentum"], a["nesterov"], a["mu"], a["weight_decay"],
                                                 a["lr_decay"]),
}

AGGREGATORS: dict[str, Factory] = {
    "fedavg": lambda a, p: aggregators.WeightedAverage(),
    "fednova": lambda a, p: aggregators.NormalizedAverage(a["tau_eff"], a.get("tau_eff_value")),
}

SERVER_OPTIMIZERS: dict[str, Factory] = {
    "sgd": lambda a, p: server.ServerSGD(a["server_lr"]),
    "momentum": lambda a, p: server.ServerMomentum(a["server_lr"], a["server_momentum"]),
    "nesterov": lambda a, p: server.ServerMomentum(a["server_lr"], a["server_momentum"], nesterov=True),
    "adam": lambda a, p: server.ServerAdam(a["server_lr"], a["server_beta1"], a["server_beta2"], a["server_eps"]),
    "yogi": lambda a, p: server.ServerAdam(a["server_lr"], a["server_beta1"], a["server_beta2"], a["server_eps"],
                                           yogi=True),
}

PARTS: dict[str, dict[str, Factory]] = {
    "sampler": SAMPLERS, "local_work": LOCAL_WORK, "lr_schedule": SCHEDULES, "solver": SOLVERS,
    "aggregator": AGGREGATORS, "server_optimizer": SERVER_OPTIMIZERS,
}
BUILTIN_PARTS: dict[str, frozenset[str]] = {kind: frozenset(reg) for kind, reg in PARTS.items()}  # before any user's


def _part(kind: str, acfg: dict[str, Any], problem) -> Any:
    registry, name = PARTS[kind], acfg[kind]
    if name not in registry:
        raise ConfigError(f"algorithm.{kind}", name, registry.keys())
    return registry[name](acfg, problem)


def build_algorithm(acfg: dict[str, Any], problem) -> Algorithm:
    batch_size = acfg["batch_size"]
    require(isinstance(batch_size, int) and batch_size >= 1, "algorithm.batch_size", batch_size,
            "must be an integer >= 1")
    return Algorithm(
        name=acfg["name"],
        sampler=samplers.with_dropout(_part("sampler", acfg, problem), acfg.get("dropout", 0.0)),
        local_work=local_work.with_min(_part("local_work", acfg, problem), acfg.get("local_work_min", False)),
        schedule=_part("lr_schedule", acfg, problem), solver=_part("solver", acfg, problem),
        aggregator=_part("aggregator", acfg, problem), server=_part("server_optimizer", acfg, problem),
        batch_size=batch_size,
    )
