"""A budget held fixed across trials: each trial gets as many rounds as its configuration can afford.

Kinds (what is counted, as in the `rounds/` Parquet counters of the run):

* `rounds`: communication rounds; the trial runs exactly `total` rounds.
* `local_steps`: cumulative local steps (per round, the largest tau_k of the round), so with
  fixed local steps E a trial runs floor(total / E) rounds: E = 10 gets a tenth of the rounds of E = 1.
* `grad_evals`: stochastic gradient evaluations (sum over trained clients of tau_k * batch size).
* `bytes`: bytes communicated, up plus down.

The rounds are found by replaying the engine's own round plans (sampled clients, tau_k,
replica layout) and counters without training, so the count matches what the run records:
the trial runs the largest number of rounds whose cost is <= total on every replica. What is
left (less than one round's cost) goes unused; `budget_used` in `trials/` says how much was spent.

A replay is paid once per cost-relevant setting: the rounds are cached under what the replay reads of the config
(REPLAY_KEYS) less the keys that only scale steps (learning rates, momentum, regularisation; COST_FREE), so a study
over client_lr x E replays once per E.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedharness.algorithms.aggregators import WeightedAverage
from fedharness.algorithms.local_work import FixedSteps
from fedharness.contracts import Algorithm, ReplicaLayout
from fedharness.assembly.build import algorithm_for, compression_for
from fedharness.assembly.systems import cadence_for, clock_for, systems_on
from fedharness.core.engine import Engine
from fedharness.core.planning import NetworkModel, client_bytes
from fedharness.core.stages import Stages
from fedharness.algorithms.series import build_series
from fedharness.registry.binding import key_parameters
from fedharness.registry.groups import PARTS
from fedharness.errors import ConfigError, require
from fedharness.problems import build_problem
from fedharness.settings import RunSettings

KINDS = ("local_steps", "rounds", "grad_evals", "bytes")
MAX_ROUNDS = 1_000_000  # a budget that needs more rounds than this is a typo, not a study
# algorithm keys that scale or regularise steps but never change a round's plan (clients, tau_k, which trains)
# nor its counters, so two configs that differ only in them cost the same
COST_FREE = ("client_lr", "server_lr", "momentum", "nesterov", "mu", "weight_decay", "lr_decay", "server_momentum",
             "server_beta1", "server_beta2", "server_eps")
_ROUNDS: dict[tuple, int] = {}  # (kind, total, cost key) -> rounds


@dataclass(frozen=True)
class Budget:
    kind: str
    total: int

    def rounds_for(self, cfg: dict[str, Any], context: str = "") -> int:
        """Rounds this config can afford; ConfigError if not even one."""
        if self.kind == "rounds":
            return self.total
        cached = (self.kind, self.total, cost_key(cfg))
        if cached not in _ROUNDS:
            spent = _cumulative_cost(cfg, self.kind, self.total)
            rounds = int(np.searchsorted(spent, self.total, side="right"))
            if rounds < 1:
                where = f" with {context}" if context else ""
                raise ConfigError("tune.budget.total", self.total,
                                  f"smaller than one round: the first round costs {int(spent[0])} {self.kind}{where}")
            if len(_ROUNDS) >= 4096:  # a study with many cost-relevant settings: keep memory bounded
                _ROUNDS.clear()
            _ROUNDS[cached] = rounds
        return _ROUNDS[cached]

    def used(self, rows: list[dict]) -> int | None:
        """What a run spent, from its last evaluated rows (the largest over replicas)."""
        final = [r for r in rows if r.get("series", "iterate") == "iterate"]
        if not final:
            return None
        last = max(r["round"] for r in final)
        final = [r for r in final if r["round"] == last]
        if self.kind == "rounds":
            return int(last)
        if self.kind == "bytes":
            return max(int(r["bytes_up"]) + int(r["bytes_down"]) for r in final)
        return max(int(r[self.kind]) for r in final)


# What _cumulative_cost reads of a config: the problem (problem_for's keys), the algorithm, and the Engine's
# arguments. Nothing else (results_dir, eval, wandb, ...) changes a replay, so studies in one process that differ
# only there (another results_dir) share their replays.
PROBLEM_KEYS = ("dataset", "partition", "model", "seed", "dtype", "device")
REPLAY_KEYS = (*PROBLEM_KEYS, "algorithm", "rounds", "replicas", "network", "cadence", "speed", "availability",
               "staleness", "compress")


def cost_key(cfg: dict[str, Any]) -> str:
    """What a replay of the config's rounds' costs depends on: REPLAY_KEYS, the algorithm less COST_FREE."""
    algorithm = {k: v for k, v in cfg["algorithm"].items() if k not in COST_FREE}
    return json.dumps({**{k: cfg.get(k) for k in REPLAY_KEYS}, "algorithm": algorithm}, sort_keys=True, default=str)


_PROBLEMS: dict[str, Any] = {}


def problem_for(cfg: dict[str, Any]):
    """Problems are rebuilt only when their config changes (the tuned keys are usually the algorithm's)."""
    key = json.dumps([cfg[k] for k in PROBLEM_KEYS]
                     + [cfg["algorithm"]["batch_size"]], sort_keys=True, default=str)
    if key not in _PROBLEMS:
        _PROBLEMS.clear()  # keep one: problems can hold whole datasets
        _PROBLEMS[key] = build_problem(RunSettings.from_config(cfg), cfg["algorithm"]["batch_size"])
    return _PROBLEMS[key]


def _cumulative_cost(cfg: dict[str, Any], kind: str, total: int) -> np.ndarray:
    """Cost after rounds 1, 2, ... (max over replicas), replayed until it passes `total`; where the costs scale with
    the local steps E (_scales_with_steps), E times those of E = 1 (bytes: the same), from one replay per study."""
    problem = problem_for(cfg)
    settings = RunSettings.from_config(cfg)
    algorithm = algorithm_for(settings, problem)
    layout, _ = build_series(cfg["replicas"], **cfg["algorithm"])
    cadence = cadence_for(settings)
    require(not cadence.spans_versions, "cadence", settings.cadence.name, f"sync with a tune.budget in {kind}: the "
            "replay plans synchronous rounds (budget an asynchronous run in rounds, its server steps)")
    if systems_on(settings, cadence):  # who takes part, and their steps, follow the clock: replay it, E's own
        return _replay(cfg, problem, algorithm, layout, kind, total)
    steps = cfg["algorithm"].get("local_steps")
    if steps != 1 and _scales_with_steps(cfg, algorithm, layout):
        try:
            unit = _unit_cost(cfg, kind, total)
        except ConfigError:  # E = 1 needs more than MAX_ROUNDS: E's own replay may not
            return _replay(cfg, problem, algorithm, layout, kind, total)
        return unit if kind == "bytes" else steps * unit
    return _replay(cfg, problem, algorithm, layout, kind, total)


_UNIT: dict[tuple, np.ndarray] = {}  # (kind, total, cost key at E = 1) -> that config's cumulative costs


def _unit_cost(cfg: dict[str, Any], kind: str, total: int) -> np.ndarray:
    """_cumulative_cost of the config with E = 1 (it passes `total` no earlier than E times it does)."""
    unit = {**cfg, "algorithm": {**cfg["algorithm"], "local_steps": 1}}
    cached = (kind, total, cost_key(unit))
    if cached not in _UNIT:
        if len(_UNIT) >= 64:
            _UNIT.clear()
        _UNIT[cached] = _cumulative_cost(unit, kind, total)
    return _UNIT[cached]


def forget_replays() -> None:
    """Forget this process's replays and the problem they were built on: what a study started in a fresh process
    pays (benchmarks/bench_tune.py times each study so, not on its predecessor's replays)."""
    _ROUNDS.clear()
    _UNIT.clear()
    _PROBLEMS.clear()


def _scales_with_steps(cfg: dict[str, Any], algorithm: Algorithm, layout: ReplicaLayout) -> bool:
    """Whether a round's counters are E times those of E = 1 (bytes: equal), replica by replica, so that E's rounds
    follow from one replay. They are when every sampled client makes exactly E steps (the built-in `steps` local
    work, no FedAvg-min: tau = E x the layout's tau_factor), which clients train is the sampler's choice alone (the
    FedAvg coefficients are the selection's weights q, whatever tau: Engine.count counts coefficient != 0), and no
    other part reads E (their factories' signatures; the replica layout compared): then local_steps adds E x
    tau_factor per round with a client, grad_evals E x tau_factor x b per client, bytes nothing that depends on E."""
    if type(algorithm.local_work) is not FixedSteps:
        return False
    if type(algorithm.aggregator).coefficients is not WeightedAverage.coefficients:
        return False
    acfg = cfg["algorithm"]
    for kind, registry in PARTS.items():
        if kind != "local_work" and any(p.name == "local_steps" for p in key_parameters(registry[acfg[kind]])):
            return False
    unit, _ = build_series(cfg["replicas"], **{**acfg, "local_steps": 1})
    return all(np.array_equal(a, b) for a, b in ((unit.stream_ids, layout.stream_ids),
                                                 (unit.tau_factor, layout.tau_factor),
                                                 (unit.lr_factor, layout.lr_factor), (unit.init_ids, layout.init_ids)))


def _replay(cfg: dict[str, Any], problem, algorithm: Algorithm, layout: ReplicaLayout, kind: str,
            total: int) -> np.ndarray:
    """The engine's own round plans and counters, without training, until the cost passes `total`: on the run's
    systems clock, with its compressed updates' size."""
    settings = RunSettings.from_config(cfg)
    compression = compression_for(settings, problem)
    stages = Stages([] if compression is None else [compression])
    clock = clock_for(settings, algorithm, problem, client_bytes(problem, algorithm.solver, stages),
                      cadence_for(settings))
    engine = Engine(problem, algorithm, None, rounds=settings.rounds, seed=settings.seed, replicas=settings.replicas,
                    eval_every=1, layout=layout, network=NetworkModel.of(settings.network), stages=stages,
                    clock=clock)
    state = engine.initial_state()
    spent: list[int] = []
    for rnd in range(MAX_ROUNDS):
        plan, _ = engine.plan_round(rnd, state.counters["sim_s"])
        engine.count(state, plan)  # the engine's own accounting, so Parquet agrees with the plan
        c = state.counters
        cost = c["bytes_up"] + c["bytes_down"] if kind == "bytes" else c[kind]
        spent.append(int(np.max(cost)))
        if spent[-1] > total:
            break
    else:
        raise ConfigError("tune.budget.total", total, f"needs more than {MAX_ROUNDS} rounds; use a smaller budget")
    return np.asarray(spent)
