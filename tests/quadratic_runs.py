"""Helpers for the closed-form tests: run the real engine on a config and read back its iterates."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedharness.contracts import ReplicaLayout
from fedharness.core.engine import Engine, RunOutcome
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import prepare
from fedharness.algorithms.series import build_series
from fedharness.settings import RunSettings


@dataclass
class Finished:
    outcome: RunOutcome
    problem: object
    reference: object
    engine: Engine

    @property
    def x(self) -> np.ndarray:
        """Final server iterates [replicas, dim], float64."""
        return self.outcome.state.x.double().numpy()

    def series(self) -> dict[str, np.ndarray]:
        """The series hooks' iterates at the end: name -> [rows, dim]."""
        out = {}
        for hook, hs in zip(self.engine.series, self.outcome.state.series_state):
            out.update({name: x.double().numpy() for name, (x, _) in hook.series(hs).items()})
        return out


def run_engine(settings: RunSettings, layout: ReplicaLayout | None = None, series_from_config: bool = False,
               executor_cls=InlineExecutor, num_shards: int = 1, eval_every: int | None = None) -> Finished:
    """prepare + Engine.run with an optional replica layout (e.g. a grid of step-size or local-step factors),
    evaluated at the end only (or every `eval_every` rounds)."""
    problem, algorithm, reference = prepare(settings)
    series = None
    if series_from_config:
        layout, series = build_series(settings.replicas, **settings.algorithm.params)
    executor = executor_cls(problem, algorithm.solver, num_shards)
    engine = Engine(problem, algorithm, executor, rounds=settings.rounds, seed=settings.seed,
                    replicas=settings.replicas, eval_every=eval_every or settings.rounds, reference=reference, layout=layout,
                    series=series)
    outcome = engine.run()
    assert outcome.status == "ok"
    return Finished(outcome, problem, reference, engine)


def factor_layout(lr_factor=None, tau_factor=None) -> ReplicaLayout:
    """Replicas that differ only by their step-size or local-step factor, sharing stream 0."""
    n = len(lr_factor if lr_factor is not None else tau_factor)
    lr = np.ones(n) if lr_factor is None else np.asarray(lr_factor, np.float64)
    tau = np.ones(n, np.int64) if tau_factor is None else np.asarray(tau_factor, np.int64)
    return ReplicaLayout(np.zeros(n, np.int64), lr, tau, np.zeros(n, np.int64))
