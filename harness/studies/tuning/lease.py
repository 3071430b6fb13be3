"""A running trial's lease: a heartbeat while it runs, so that a worker that died is found out and its
trial's slot is run again; and how many of a study's slots are finished or taken."""

from __future__ import annotations

import logging
import threading
import time

from fedharness.studies.tuning.spec import TuneSpec

logger = logging.getLogger(__name__)


class Lease:
    """Refreshes the `heartbeat_at` user attr of a trial (or of each trial of a batch, from one thread) while it
    runs, so others can tell a dead worker."""

    def __init__(self, trials, every_s: float):
        self.trials = list(trials) if isinstance(trials, (list, tuple)) else [trials]
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> "Lease":
        for trial in self.trials:
            trial.set_user_attr("heartbeat_at", time.time())
        self._thread.start()
        return self

    def add(self, trial, beaten: bool = False) -> None:
        """Beat for one more trial from now on (a batch's trials join as they are asked for); `beaten`: its first
        heartbeat is in the storage already (written with the trial: batch_writes.create_trials)."""
        if not beaten:
            trial.set_user_attr("heartbeat_at", time.time())
        self.trials.append(trial)

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s):
            for trial in list(self.trials):
                try:
                    trial.set_user_attr("heartbeat_at", time.time())
                except Exception:  # the trial was finished meanwhile (or the storage is gone): stop beating it
                    self.trials.remove(trial)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _last_beat(t) -> float:
    return float(t.user_attrs.get("heartbeat_at", t.datetime_start.timestamp() if t.datetime_start else 0.0))


def reap_lost(study, trials, spec: TuneSpec) -> bool:
    """Mark FAIL every running trial whose heartbeat is older than three beats: its worker is gone. True if it
    marked any (`trials` is then out of date)."""
    from optuna.trial import TrialState

    grace = 3 * spec.heartbeat_s
    now = time.time()
    lost = [t for t in trials if t.state == TrialState.RUNNING and now - _last_beat(t) > grace]
    for t in lost:
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        logger.warning(f"[{spec.study}] trial {t.number}: lost (no heartbeat for {now - _last_beat(t):.0f} s); "
                       "its slot is run again")
    return bool(lost)


def trial_counts(trials) -> tuple[int, int]:
    """(finished, live): finished = COMPLETE + PRUNED; live = finished + RUNNING + WAITING."""
    from optuna.trial import TrialState

    finished = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    live = sum(t.state != TrialState.FAIL for t in trials)
    return finished, live
