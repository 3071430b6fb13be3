"""`fedharness tune [--compare a,b,c] overrides...`: one study, or the same study for several algorithms."""

from __future__ import annotations

from harness.studies.tuning.compare import run_compare
from harness.studies.tuning.study import build_spec, tune


def main(overrides: list[str], compare: str | None = None) -> int:
    if compare is not None:
        return run_compare(overrides, compare)
    summary = tune(build_spec(overrides))
    print(summary["text"])
    return 0
