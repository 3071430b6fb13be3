"""One trial's run: its settings under the budget (the trial's sample recorded as user attrs), the reporter that
feeds the pruner after each evaluation, and the line printed when it finishes. Used by workers.py (one trial at a
time) and batched_trials.py (tune.batch trials as one batched run)."""

from __future__ import annotations

import logging
import os
import platform
from typing import Callable

from fedharness.contracts import Callback, RoundContext
from fedharness.runs.execute import new_run_id
from fedharness.settings import RunSettings
from fedharness.studies.tuning.optuna_parts import close_slot
from fedharness.studies.tuning.spec import TuneSpec, trial_config
from fedharness.studies.tuning.storage import tell_complete, write_trial

logger = logging.getLogger(__name__)


def trial_settings(spec: TuneSpec, trial) -> tuple[RunSettings, str]:
    """Sample the trial (with the study's sampler of the moment) and build its run under the budget, recording
    `study` and `trial`; returns its settings and run id (also set as the trial's user attrs)."""
    values = {p.name: p.suggest(trial) for p in spec.params}
    cfg, overrides = trial_config(spec, values)
    cfg["study"], cfg["trial"] = spec.study, trial.number
    if isinstance(cfg.get("wandb"), dict):  # W&B hook: one run per trial, grouped by study (group null = study)
        cfg["wandb"]["tags"] = [*cfg["wandb"].get("tags", []), f"trial={trial.number}"]
    run_id = new_run_id()
    worker = f"{platform.node()}:{os.getpid()}"
    write_trial(trial, {"run_id": run_id, "rounds": cfg["rounds"], "overrides": overrides, "worker": worker})
    return RunSettings.from_config(cfg), run_id


class Reporter(Callback):
    """Feeds pruners, a hook of the trial's run: after each evaluation, the objective's metric at step = the budget
    fraction spent, in units of 1/reports, so trials with different local steps are compared at equal budget. A
    prune raises optuna.TrialPruned, which ends the run `pruned`. Where the study has no pruner (NopPruner:
    tune.pruner.name=none) nothing reads the values while the trial runs: they wait in `pending` and are stored
    with the trial's outcome (`finish`), in one write."""

    def __init__(self, spec: TuneSpec, trial, rounds: int):
        import optuna

        self.spec, self.trial, self.rounds = spec, trial, rounds
        self.reports = spec.reports or rounds
        self.last_step = 0
        self.rows: list[dict] = []
        unread = isinstance(trial.study.pruner, optuna.pruners.NopPruner)
        self.pending: dict[int, float] | None = {} if unread else None

    def on_end(self, outcome) -> None:
        close_slot(self.trial.study, self.trial.number)  # a batch-native pruner stops waiting for its reports

    def finish(self, attrs: dict) -> None:
        """Store the trial's outcome `attrs` (user attrs) and its pending reports."""
        write_trial(self.trial, attrs, self.pending)
        self.pending = {} if self.pending is not None else None

    def complete(self, attrs: dict, value: float) -> None:
        """finish, and the trial told COMPLETE with `value`, in one write (storage.tell_complete)."""
        tell_complete(self.trial, value, attrs, self.pending)
        self.pending = {} if self.pending is not None else None

    def on_evaluation(self, context: RoundContext) -> None:
        self(context.rows, context.state)

    def __call__(self, rows: list[dict], state) -> None:
        import optuna

        self.rows = rows
        if self.spec.objective.target is not None or not rows:
            return
        rnd = rows[0]["round"]
        step = round(self.reports * rnd / self.rounds)
        value = self.spec.objective.intermediate(rows)
        if rnd == 0 or step <= self.last_step or value is None:
            return
        self.last_step = step
        if self.pending is not None:
            self.pending[step] = value
            return
        self.trial.report(value, step)
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at round {rnd} ({step}/{self.reports} of the budget)")


def trial_line(spec: TuneSpec, trial, value: float | None, status: str | None = None) -> str:
    attrs = trial.user_attrs
    status = status or attrs.get("status")
    shown = "-" if value is None else f"{value:.6g}"
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    batch = f"batch {attrs['batch_id']}; " if attrs.get("batch_id") else ""  # the batched run it trained in
    return (f"[{spec.study}] trial {trial.number}: {spec.objective.name} = {shown} ({status}; {batch}"
            f"{attrs.get('rounds')} rounds, {attrs.get('budget_used')}/{spec.budget.total} {spec.budget.kind}) "
            f"{params}")


def tell_value(spec: TuneSpec, reporter: Reporter, attrs: dict, value: float, echo: Callable[[str], None]) -> int:
    """Store the trial's outcome `attrs` and tell Optuna its value (Reporter.complete), and echo its line; 1, or 0
    when it was declared lost while it ran (missed heartbeats: another worker runs it again)."""
    import optuna

    trial = reporter.trial
    try:
        reporter.complete(attrs, value)
    except optuna.exceptions.UpdateFinishedTrialError:
        warn_lost(spec, trial)
        return 0
    echo(trial_line(spec, trial, value))
    return 1


def warn_lost(spec: TuneSpec, trial) -> None:
    """The line for a trial that finished after it was declared lost (missed heartbeats): it is not counted."""
    logger.warning(f"[{spec.study}] trial {trial.number}: finished after it was declared lost; not counted")
