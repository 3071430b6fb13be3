"""What a trial is scored by: a metric of the final evaluated round, or the rounds to reach a target.

Both are read from the run's rows of series `iterate` (the server model), averaged over
replicas. A diverged run (or a non-finite final metric) scores the worst value there is:
+inf when minimizing, -inf when maximizing. Optuna stores it as a COMPLETE trial, so the
samplers learn that region is bad, and the trial's `status` says `diverged`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedharness.registry.groups import METRICS as USER_METRICS
from fedharness.errors import require

# client_*: eval.per_client's spread over clients (fairness: tune for the worst 10% of clients, client_acc_p10)
CLIENT_METRICS = tuple(f"client_{m}_{s}" for m in ("acc", "loss") for s in ("mean", "p10", "p50", "p90"))
METRICS = ("train_loss", "subopt", "dist_to_opt", "grad_norm_sq", "test_loss", "test_acc", *CLIENT_METRICS)
MAXIMIZED = ("test_acc", *(m for m in CLIENT_METRICS if m.startswith("client_acc_")))
DIRECTIONS = ("auto", "minimize", "maximize")


def maximized(metric: str) -> bool:
    """Larger is better: test accuracy (pooled or per client), and a user's metric registered with maximize=True."""
    return metric in MAXIMIZED or (metric in USER_METRICS and USER_METRICS[metric].maximize)


@dataclass(frozen=True)
class Objective:
    metric: str
    direction: str           # of the study: minimize | maximize
    target: float | None     # set: the score is the rounds until `metric` reaches `target`

    @classmethod
    def of(cls, metric: str, direction: str, target: float | None) -> "Objective":
        """The objective of checked `tune.objective` keys (fedharness.studies.tuning.spec declares them)."""
        metric_dir = "maximize" if maximized(metric) else "minimize"
        if target is not None:
            require(direction in ("auto", "minimize"), "tune.objective.direction", direction,
                    "rounds to a target are minimized: use auto or minimize")
            return cls(metric, "minimize", float(target))
        return cls(metric, metric_dir if direction == "auto" else direction, None)

    @property
    def metric_maximized(self) -> bool:
        return maximized(self.metric) if self.target is not None else self.direction == "maximize"

    @property
    def run_metrics(self) -> list[str]:
        """The user metric a trial's run must compute for this objective (none for a built-in metric)."""
        return [self.metric] if self.metric in USER_METRICS else []

    @property
    def name(self) -> str:
        if self.target is None:
            return f"final {self.metric}"
        return f"rounds to {self.metric} {'>=' if self.metric_maximized else '<='} {self.target:g}"

    @property
    def worst(self) -> float:
        return math.inf if self.direction == "minimize" else -math.inf

    def per_replica(self, rows: list[dict], status: str) -> np.ndarray:
        """The score of each replica (worst for a diverged run or a non-finite value)."""
        it = [r for r in rows if r.get("series", "iterate") == "iterate"]
        replicas = sorted({r["replica"] for r in it})
        if status == "diverged" or not it:
            return np.full(max(len(replicas), 1), self.worst)
        if self.target is None:
            last = max(r["round"] for r in it)
            by_rep = {r["replica"]: r.get(self.metric) for r in it if r["round"] == last}
            return np.array([self.worst if by_rep.get(k) is None else float(by_rep[k]) for k in replicas])
        return np.array([self._rounds_to_target([r for r in it if r["replica"] == k]) for k in replicas])

    def _rounds_to_target(self, rows: list[dict]) -> float:
        for r in sorted(rows, key=lambda r: r["round"]):
            v = r.get(self.metric)
            if v is not None and (v >= self.target if self.metric_maximized else v <= self.target):
                return float(r["round"])
        return math.inf  # never reached within the budget

    def value(self, rows: list[dict], status: str) -> float:
        """The trial's score: for a final metric the mean over replicas; for a target the mean curve's first hit."""
        if self.target is None:
            return float(np.mean(self.per_replica(rows, status)))
        if status == "diverged":
            return self.worst
        return self._rounds_to_target(mean_curve(rows, self.metric))

    def intermediate(self, rows: list[dict]) -> float | None:
        """The value reported to pruners after an evaluation (final-metric objectives only)."""
        vals = [r.get(self.metric) for r in rows if r.get("series", "iterate") == "iterate"]
        if not vals or any(v is None for v in vals):
            return None
        return float(np.mean(vals))


def mean_curve(rows: list[dict], metric: str) -> list[dict]:
    """One row per evaluated round: the replica mean of `metric` (None if any replica has none)."""
    by_round: dict[int, list] = {}
    for r in rows:
        if r.get("series", "iterate") == "iterate":
            by_round.setdefault(r["round"], []).append(r.get(metric))
    return [{"round": k, metric: None if any(v is None for v in vs) else float(np.mean(vs))}
            for k, vs in sorted(by_round.items())]
