"""cadence=sync: synchronous rounds (contracts.Cadence). Every sampled client starts from the server's model, the
server waits for the round's clients (on the systems clock: those online, in time for the deadline, the first K to
finish with over-selection: core/clock.py settles the plan) and steps with their aggregate."""

from __future__ import annotations

from dataclasses import dataclass

from fedharness.contracts import RunState


@dataclass(frozen=True)
class Synchronous:
    """A round a server version: plan, train, count, step."""

    spans_versions = False

    def sampled(self, clients_per_round: int) -> int:
        return clients_per_round

    def init_flight(self, replicas: int, dim: int, device) -> dict:
        return {}

    def step(self, engine, state: RunState) -> RunState:
        plan, coefs = engine.plan_round(state.round, state.counters["sim_s"])
        delta, sq_norms = engine.train_round(state, plan)
        engine.count(state, plan)
        return engine.advance(state, delta, plan.step_lrs[..., 0], coefs, **sq_norms)
