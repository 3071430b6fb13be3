"""`tune.batch=B`: a worker asks Optuna for B trials at a time, trains them as batched runs (fedharness.runs.execute, one
slot per trial; trials that differ in more than batchable keys go to separate batches) and tells Optuna each value.

Per trial, everything is as in workers.py's one-at-a-time path: the trial is sampled with the sampler seeded by its
trial number (so `sampler=random` proposes the same trials batched or not), its budget gives its own rounds, its
reporter feeds the pruner (a pruned slot leaves the batch at that report), and its run is recorded in runs/ with
`study` and `trial`. A failed slot is recorded FAIL (status failed, so it does not count and its slot is run again)
after every other slot of the batch has been told; then the study stops with its error, as a failed trial stops it
today. An interrupt ends every trial of the batch FAIL (status interrupted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from fedharness.runs.batch import Slot
from fedharness.runs.execute import RunResult, execute_runs, new_run_id
from fedharness.settings import RunSettings
from fedharness.results.store import ResultsStore
from fedharness.studies.grouping import group_batches
from fedharness.studies.tuning.batch_writes import Completions, create_trials
from fedharness.studies.tuning.lease import Lease, trial_counts
from fedharness.studies.tuning.optuna_parts import ask_trial, next_batch_size, open_bracket, start_trial
from fedharness.studies.tuning.spec import TuneSpec
from fedharness.studies.tuning.storage import held_writes
from fedharness.studies.tuning.trial import Reporter, trial_line, trial_settings, warn_lost

logger = logging.getLogger(__name__)


class TrialFailed(RuntimeError):
    """A slot of a batch failed: its trial is FAIL and the rest of the batch was told; the same command goes on."""


class SlotReporter(Reporter):
    """The trial's reporter, remembering whether it pruned the slot (the slot's run then ends `pruned`) or failed it
    (the error, for the trial)."""

    pruned = False
    error: str | None = None

    def __call__(self, rows: list[dict], state) -> None:
        import optuna

        try:
            super().__call__(rows, state)
        except optuna.TrialPruned:
            self.pruned = True
            raise
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
            raise


@dataclass
class BatchTrial:
    trial: object          # the optuna Trial
    settings: RunSettings
    run_id: str
    reporter: SlotReporter
    batch_id: str | None = None  # the batched run it trained in (None: alone)


def run_batch(spec: TuneSpec, study, worker: int, echo: Callable[[str], None] = logger.info,
              store: ResultsStore | None = None, trials: list | None = None) -> int:
    """Ask for up to spec.batch trials (no more than the study still lacks), train them (recording into `store`,
    default: the results_dir's), tell each; returns how many finished (complete or pruned). `trials`: the study's
    trials as the caller has just read them (default: read here)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False) if trials is None else trials
    finished, live = trial_counts(trials)
    size = next_batch_size(spec, finished, live)
    if size == 0:  # start-up trials still run elsewhere: the next batch's proposals wait for their values
        time.sleep(min(1.0, spec.heartbeat_s))
        return 0
    claimed, asked = [], []
    queued = any(t.state == TrialState.WAITING for t in trials)  # enqueued trials: asked for through study.ask
    created = None if queued else create_trials(study, size, time.time())  # None: a journal, asked one by one
    with Lease([], spec.heartbeat_s) as lease:
        try:
            with held_writes():  # the trials' settings attrs, written together once all are sampled
                for i in range(size):
                    known = (len(trials) + i, live + len(claimed))  # (its number, non-failed before it) if alone
                    new = None if created is None else created[i]
                    trial = _claim(spec, study, worker, lease, known, queued, new)
                    if trial is not None:
                        claimed.append(trial)
                        settings, run_id = trial_settings(spec, trial)  # sampled now, with this trial's sampler
                        asked.append(BatchTrial(trial, settings, run_id, SlotReporter(spec, trial, settings.rounds)))
            open_bracket(study, claimed)  # tune.pruner.name=hyperband ranks these trials together
            results = _train(asked, store)
        except BaseException as err:  # an interrupt (or a bug) before every slot had its result: all are FAIL
            _fail(study, claimed, err, [frozen.number for frozen in created or []])
            raise
    counted = _tell_all(spec, study, asked, results, echo)
    failed = [a.trial for a, result in zip(asked, results) if _failed(a, result)]
    if failed:
        numbers = ", ".join(str(trial.number) for trial in failed)
        raise TrialFailed(f"[{spec.study}] trial(s) {numbers} failed: {failed[0].user_attrs['error']}")
    return counted


def _claim(spec: TuneSpec, study, worker: int, lease: Lease, known: tuple[int, int], queued: bool,
           created=None):
    """A new trial with its heartbeat on; None if n_trials non-failed trials precede it (FAIL, status surplus).
    `known`: the number the trial gets and the non-failed trials before it when no other worker asked for a trial
    since the batch read the study; the study is read again only when one did (a read per trial costs O(batch^2)).
    `queued`: the study held WAITING trials when the batch read it (study.ask takes those first). `created`: the
    trial's FrozenTrial, created with its heartbeat (batch_writes.create_trials); None: asked for here."""
    from optuna.trial import TrialState

    if created is None:
        trial = ask_trial(spec, study, worker, queued)
    else:
        trial = start_trial(spec, study, worker, created._trial_id, created)
    lease.add(trial, beaten=created is not None)
    expected, earlier = known  # trials can only turn FAIL meanwhile: `earlier` is exact or too many (safe)
    if trial.number != expected:
        earlier = sum(t.number < trial.number and t.state != TrialState.FAIL for t in study.get_trials(deepcopy=False))
    if earlier >= spec.n_trials:
        trial.set_user_attr("status", "surplus")
        study.tell(trial, state=TrialState.FAIL)
        return None
    return trial


def _train(asked: list[BatchTrial], store: ResultsStore | None) -> list[RunResult]:
    """The trials' runs, one run per group of trials that can train together (a group of one trains alone, as
    without tune.batch); results in trial order."""
    results: list[RunResult | None] = [None] * len(asked)
    for group in group_batches([a.settings for a in asked], len(asked)):
        batch_id = new_run_id() if len(group) > 1 else None
        slots = [Slot(asked[i].settings, asked[i].run_id, hooks=[asked[i].reporter]) for i in group]
        for i, result in zip(group, execute_runs(slots, batch_id=batch_id, store=store)):
            asked[i].batch_id = batch_id
            results[i] = result
    return results


def _failed(a: BatchTrial, result: RunResult) -> bool:
    return not a.reporter.pruned and result.status in ("failed", "pruned", "interrupted")


def _tell_all(spec: TuneSpec, study, asked: list[BatchTrial], results: list[RunResult],
              echo: Callable[[str], None]) -> int:
    """Record the trials' outcomes in Optuna, in trial order (as workers.py does for one trial), the COMPLETE ones
    in one transaction (batch_writes.Completions), then echo each finished trial's line; how many finished."""
    from optuna.trial import TrialState

    completions, finished = Completions(study), []  # finished: (trial, value or None) in trial order
    for a, result in zip(asked, results):
        trial = a.trial
        batch = {"batch_id": a.batch_id} if a.batch_id is not None else {}
        if a.reporter.pruned:
            a.reporter.finish({**batch, "status": "pruned", "budget_used": spec.budget.used(a.reporter.rows)})
            study.tell(trial, state=TrialState.PRUNED)
            finished.append((trial, None))
        elif _failed(a, result):
            error = result.error or a.reporter.error or f"its run {a.run_id} failed (see its runs/ row)"
            a.reporter.finish({**batch, "status": "failed", "error": error})
            study.tell(trial, state=TrialState.FAIL)
        else:
            value = spec.objective.value(result.rows, result.status)
            attrs = {**batch, "status": result.status, "budget_used": spec.budget.used(result.rows)}
            completions.add(trial, value, attrs, a.reporter.pending)
            finished.append((trial, value))
    lost = completions.commit()
    for trial, value in finished:
        if trial.number in lost:
            warn_lost(spec, trial)
        else:
            echo(trial_line(spec, trial, value))
    return len(finished) - len(lost)


def _fail(study, trials: list, err: BaseException, created: list[int]) -> None:
    """FAIL, not PRUNED, also when interrupted: the slots are run again. `created`: the numbers of the trials
    created for the batch (batch_writes.create_trials); those not yet claimed are failed too (not waited for)."""
    from optuna.trial import TrialState

    interrupted = isinstance(err, KeyboardInterrupt)
    for trial in trials:
        trial.set_user_attr("status", "interrupted" if interrupted else "failed")
        trial.set_user_attr("error", f"interrupted by {err}" if interrupted else f"{type(err).__name__}: {err}")
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
    for number in created:  # the claimed ones and the surplus ones are finished: skipped
        study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
