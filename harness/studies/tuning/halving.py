"""Batch-native Hyperband (`tune.pruner.name=hyperband` with `tune.batch`): each batch is one successive-halving
bracket. Its trials train together as one batched run; at each rung (a budget fraction, in reports) the bracket's
trials are ranked once all of them have reached it, the best 1/reduction_factor go on in the same batched run and
the others are pruned (their slots leave the batch at their next report).

Rungs are at min_resource * reduction_factor^k reports (k = s, s+1, ... below tune.reports), where the bracket
index s cycles over the batches a worker runs: s = 0 prunes from the first rung on, the last bracket prunes nothing
(Hyperband's hedge between many cheap trials and few full ones). A trial's value at a rung is its report at the
first step at or past the rung: trials with different E reach a rung at different rounds of the batched run, and
the ones that get there first train on until the whole rung has reported (never pruned on a partial ranking). A
trial that finished its budget before a decision is complete. A member whose run ended (diverged at once, failed,
finished) is ranked at the rungs it reached and waited for at no other (the reporter's on_end calls `leave`); a
member still running that has not reported (a group of the batch that trains after this one) holds its rung's
decision back, so its bracket prunes less, never wrongly.
"""

from __future__ import annotations

import math

import optuna


class BatchHyperband(optuna.pruners.BasePruner):
    """Synchronous successive halving over the trials of each batch (open_bracket names them)."""

    def __init__(self, reports: int, min_resource: int, reduction_factor: int):
        self.reports, self.min_resource, self.eta = reports, min_resource, reduction_factor
        self.brackets = 0  # batches opened so far: the next one's bracket index cycles with it
        self.members: set[int] = set()
        self.rungs: tuple[int, ...] = ()
        self.values: dict[int, dict[int, float]] = {}    # rung -> trial number -> value at that rung
        self.kept: dict[int, set[int]] = {}               # rung -> the trials that go on past it (once decided)

    def rungs_of(self, bracket: int) -> tuple[int, ...]:
        """The rungs (in reports) of bracket index `bracket`; the brackets cycle over 0..len(rungs of 0)."""
        every = [self.min_resource * self.eta ** k for k in range(64)]
        first = [rung for rung in every if rung < self.reports]
        return tuple(first[bracket % (len(first) + 1):])

    def open_bracket(self, numbers: list[int]) -> None:
        """A new batch: its trials form the next bracket."""
        self.rungs = self.rungs_of(self.brackets)
        self.brackets += 1
        self.members = set(numbers)
        self.left: set[int] = set()  # members whose runs ended (leave)
        self.values = {rung: {} for rung in self.rungs}
        self.kept = {}

    def leave(self, number: int) -> None:
        """Trial `number`'s run ended (diverged, spent its budget, failed, pruned): it holds back no rung it has
        not reached, and is ranked only at those it reached. Without this a slot that diverged at once, and never
        reported, kept every rung of its bracket undecided, so nothing was pruned."""
        self.left.add(number)

    def prune(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> bool:
        if trial.number not in self.members:  # asked outside a batch (a lone trial): never pruned
            return False
        sign = 1.0 if study.direction == optuna.study.StudyDirection.MINIMIZE else -1.0
        for rung in self.rungs:  # record every rung reached first: a trial's last report may pass several
            at = [step for step in trial.intermediate_values if step >= rung]
            if at:
                value = trial.intermediate_values[min(at)]
                self.values[rung].setdefault(trial.number, sign * value if math.isfinite(value) else math.inf)
        for rung in self.rungs:
            if trial.number not in self.values[rung]:
                return False  # not there yet
            kept = self._decide(rung)
            if kept is None:
                return False  # the rung's ranking waits for the rest of the bracket
            if trial.number not in kept:
                return True
        return False

    def _decide(self, rung: int) -> set[int] | None:
        """The trials that go on past `rung`, once every trial that went on past the previous rung has reached it."""
        if rung not in self.kept:
            index = self.rungs.index(rung)
            entrants = self.members if index == 0 else self.kept.get(self.rungs[index - 1])
            if entrants is None:
                return None
            reached = entrants & self.values[rung].keys()
            if entrants - reached - self.left:
                return None  # a member still running has not reached it
            ranked = sorted(reached, key=lambda n: (self.values[rung][n], n))
            self.kept[rung] = set(ranked[:max(1, len(ranked) // self.eta)])
        return self.kept[rung]

