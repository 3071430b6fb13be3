"""`fedharness tune [--compare a,b,c] overrides...`: one study, or the same study for several algorithms."""

from __future__ import annotations

import shlex
import sys

from fedharness.runs.lifecycle import RunInterrupted, interrupts_raised, open_results
from fedharness.base.progress import echo
from fedharness.studies.tuning.compare import run_compare
from fedharness.studies.tuning.spec import build_spec
from fedharness.studies.tuning.study import StudyInterrupted, tune


def main(overrides: list[str], compare: str | None = None) -> int:
    """SIGINT/SIGTERM end it with one line on stderr and exit status 130/143 (128 + the signal)."""
    command = shlex.join(["fedharness", "tune", *overrides, *(["--compare", compare] if compare else [])])
    with interrupts_raised():  # also while the line is printed, so a second signal cannot cut it short
        try:
            if compare is not None:
                return run_compare(overrides, compare)
            spec = build_spec(overrides)
            summary = tune(spec, open_results(spec.results_dir), echo=echo)
        except StudyInterrupted as err:
            print(f"fedharness: study {err.study} interrupted ({err}) with {err.finished} of {err.n_trials} trials "
                  f"finished; the same command continues it: {command}", file=sys.stderr)
            return err.exit_code
        except RunInterrupted as err:  # before the study existed, or in --compare's re-runs
            print(f"fedharness: tune interrupted ({err}); the same command continues: {command}", file=sys.stderr)
            return err.exit_code
    print(summary["text"])
    return 0
