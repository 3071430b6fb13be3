"""Privacy accounting of DP-FedAvg with Google's `dp-accounting` (the 'privacy' extra), never by hand.

A round of DP-FedAvg samples each client independently with probability q (the poisson sampler) and adds Gaussian
noise of std z * C to the sum of the updates clipped to C: a Poisson-subsampled Gaussian mechanism of noise
multiplier z. `rounds` of them compose. The accountant (`rdp`: Renyi DP, Mironov et al.; `pld`: privacy loss
distributions, Koskela et al. / Doroshenko et al.) turns that into epsilon at a given delta; `calibrate` finds the
z that reaches a target epsilon (dp_accounting.mechanism_calibration).
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

from fedharness.base.extras import require_extra

ACCOUNTANTS = ("rdp", "pld")


def _dp_accounting():
    return require_extra("dp_accounting", "dp.accountant", "rdp")


def round_event(q: float, z: float):
    """One round's DpEvent: the Gaussian mechanism of noise multiplier z on a Poisson sample of rate q."""
    dp = _dp_accounting()
    gaussian = dp.GaussianDpEvent(z)
    return gaussian if q >= 1.0 else dp.PoissonSampledDpEvent(q, gaussian)


def run_event(q: float, z: float, rounds: int):
    """`rounds` rounds composed."""
    return _dp_accounting().SelfComposedDpEvent(round_event(q, z), rounds)


def new_accountant(kind: str):
    """A fresh accountant of `kind` (rdp | pld) with dp_accounting's defaults (add-or-remove-one neighbours)."""
    dp = _dp_accounting()
    return dp.rdp.RdpAccountant() if kind == "rdp" else dp.pld.PLDAccountant()


@contextmanager
def _quiet_orders() -> Iterator[None]:
    """The RDP accountant logs (absl, WARNING) each fractional order whose series does not converge at large q and
    leaves it out of the minimum over orders; that is its documented behaviour, not news for the run's output.
    absl's log() also calls logging.basicConfig() when the root logger has no handler, whatever the level: that
    handler would stay and print every later log line of the process a second time (the CLI's own handler prints
    it once). So while the accountant runs, a root logger without handlers holds a NullHandler; a program's own
    root handlers are left as they are."""
    log, root = logging.getLogger("absl"), logging.getLogger()
    level, placeholder = log.level, None if root.handlers else logging.NullHandler()
    log.setLevel(logging.ERROR)
    if placeholder is not None:
        root.addHandler(placeholder)
    try:
        yield
    finally:
        log.setLevel(level)
        if placeholder is not None:
            root.removeHandler(placeholder)


@lru_cache(maxsize=4096)
def epsilon(kind: str, q: float, z: float, rounds: int, delta: float) -> float:
    """Epsilon at `delta` after `rounds` rounds (0 before the first; inf without noise)."""
    if rounds == 0:
        return 0.0
    if z == 0:
        return math.inf
    with _quiet_orders():
        return float(new_accountant(kind).compose(run_event(q, z, rounds)).get_epsilon(delta))


def calibrate(kind: str, q: float, rounds: int, delta: float, target_epsilon: float) -> float:
    """The noise multiplier z at which `rounds` rounds reach `target_epsilon` at `delta`."""
    calibration = require_extra("dp_accounting.mechanism_calibration", "dp.target_epsilon", target_epsilon)
    with _quiet_orders():
        return float(calibration.calibrate_dp_mechanism(lambda: new_accountant(kind),
                                                        lambda z: run_event(q, z, rounds), target_epsilon, delta))


def composed_epsilon(kind: str, runs: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at `delta` of several DP runs on the same clients, each (q, z, rounds): what a tuning study or a
    sweep on private data has spent in all (every trial looks at the data; tuning on private data costs privacy)."""
    noisy = [(q, z, rounds) for q, z, rounds in runs if rounds > 0]
    if not noisy:
        return 0.0
    if any(z == 0 for _, z, _ in noisy):
        return math.inf
    event = _dp_accounting().ComposedDpEvent([run_event(q, z, rounds) for q, z, rounds in noisy])
    with _quiet_orders():
        return float(new_accountant(kind).compose(event).get_epsilon(delta))
