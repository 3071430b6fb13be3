"""Which exact references a run gets: `reference: auto | on | off`, each solve bounded in time, with progress.

`auto` solves only where the minimiser exists for sure (strongly convex objectives) and gives up,
saying so once (a logged warning), when a solve does not converge within `reference_timeout_s`; `on`
always solves and stops the run with one clear error where it cannot; `off` never solves.
Without a reference, subopt, dist_to_opt, f_star and gamma_heterogeneity are null.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import numpy as np

from fedharness.contracts import ExactSolve
from fedharness.references.closed_forms import client_minima
from fedharness.errors import ConfigError, require
from fedharness.base.progress import progress_bar
from fedharness.references.solve import Reference, SolveFailed, SolveProgress, optimum_doubt, solve_reference
from fedharness.assembly.reference_cache import cached_client_minima, cached_reference
from fedharness.settings import RunSettings

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
_REPORTED: set[str] = set()  # a tuning study or sweep runs many configs in one process: say each thing once


def policy(reference: str | bool, timeout_s: float | None) -> tuple[str, float | None]:
    """(mode, time bound in seconds or None) of `reference` and `reference_timeout_s`; the schema has checked
    both. YAML reads a bare on/off as a bool."""
    mode = {True: "on", False: "off"}[reference] if isinstance(reference, bool) else reference
    return mode, None if timeout_s is None else float(timeout_s)


def settings(cfg: Mapping[str, Any]) -> tuple[str, float | None]:
    """The policy of a plain config (defaults where it has no such keys)."""
    return policy(cfg.get("reference", "auto"), cfg.get("reference_timeout_s", DEFAULT_TIMEOUT_S))


def _report(message: str) -> None:
    if message not in _REPORTED:
        _REPORTED.add(message)
        log.warning(message)


def _unavailable(run: RunSettings, problem) -> str | None:
    """Why no exact reference can be solved for at all (non-convex, or F never built)."""
    if not problem.convex:
        return f"model={run.model.name} is not convex"
    if not isinstance(problem, ExactSolve):
        return f"dataset={run.dataset.name} never builds the full objective F"
    return None


@contextmanager
def _status(enabled: bool, what: str) -> Iterator[SolveProgress]:
    """A one-line stderr status of a solve, shown once it has taken a second: Newton step, CG step, ||grad F||."""
    bar = progress_bar(what, enabled=enabled, delay=1.0, bar_format="{desc} [{elapsed}]{postfix}")  # lines in logs

    def tick(newton: int, cg: int, grad_norm: float) -> None:
        bar.set_postfix_str(f"Newton step {newton + 1}, CG step {cg}, ||grad F|| = {grad_norm:.2e}", refresh=False)
        bar.update()

    try:
        yield tick
    finally:
        bar.close()


def _give_up(mode: str, what: str, why: str, timeout: float | None) -> None:
    """A failed solve: under `on` one clear error; under `auto` one message, and the values stay null."""
    bound = "no time bound" if timeout is None else f"reference_timeout_s={timeout:g}"
    if mode == "on":
        raise ConfigError("reference", "on", f"solving for the {what} failed ({why}; {bound}); allow more "
                          "time with reference_timeout_s, or set reference=auto (skip) or reference=off")
    _report(f"no {what}: {why} ({bound}); reference=on makes this an error.")


def skip_reason(run: RunSettings, problem) -> str | None:
    """Why the run gets no exact reference, known before any solve; None when it solves.
    ConfigError where `reference=on` asks for what cannot be solved."""
    mode, _ = policy(run.reference, run.reference_timeout_s)
    if mode == "off":
        return "reference=off"
    why_not = _unavailable(run, problem)
    if why_not is not None:
        require(mode != "on", "reference", "on", f"needs a convex problem with an exact objective: {why_not} "
                "(use reference=auto or off)")
        return why_not
    return optimum_doubt(problem) if mode == "auto" else None


def run_reference(run: RunSettings, problem) -> Reference | None:
    """w* and F* of the run's objective under `reference`, from the cache when solved before."""
    mode, timeout = policy(run.reference, run.reference_timeout_s)
    why = skip_reason(run, problem)
    if why is not None:
        if mode == "auto" and _unavailable(run, problem) is None:  # convex, yet skipped: say why, once
            _report(f"no exact reference: {why}; subopt and dist_to_opt are null. reference=on forces a solve.")
        return None
    doubt = optimum_doubt(problem)
    if doubt is not None:
        _report(f"reference=on: {doubt}; the solve may stop far out where F keeps decreasing.")
    try:
        with _status(run.progress, "fedharness: exact reference w*") as tick:
            return cached_reference(run.config, lambda: solve_reference(problem, timeout_s=timeout, progress=tick),
                                    timeout)
    except SolveFailed as err:
        _give_up(mode, "exact reference", f"{err}", timeout)
        return None


def run_client_minima(run: RunSettings, problem, reference: Reference | None) -> np.ndarray | None:
    """Every client's F_k* for Li et al.'s Gamma (`heterogeneity: true`), within one time bound for all clients."""
    if reference is None or not run.heterogeneity:
        return None
    mode, timeout = policy(run.reference, run.reference_timeout_s)
    deadline = None if timeout is None else time.monotonic() + timeout

    def solve_all(tick: SolveProgress) -> np.ndarray | None:
        left = lambda: None if deadline is None else max(0.0, deadline - time.monotonic())  # noqa: E731
        return client_minima(problem, lambda sub: solve_reference(sub, timeout_s=left(), progress=tick))

    try:
        with _status(run.progress, "fedharness: clients' minima F_k*") as tick:
            return cached_client_minima(run.config, lambda: solve_all(tick), timeout)
    except SolveFailed as err:
        _give_up(mode, "heterogeneity Gamma (clients' minima F_k*)", f"{err}", timeout)
        return None
