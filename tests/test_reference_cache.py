"""The reference cache returns the solved reference again, and only for the same objective."""

from __future__ import annotations

import numpy as np

from fedharness.references.solve import Reference
from fedharness.assembly.reference_cache import cached_reference


def test_hit_returns_the_stored_reference_and_other_objectives_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHARNESS_CACHE", str(tmp_path / "cache"))
    cfg = {"results_dir": str(tmp_path / "results"), "dataset": {"name": "synthetic", "alpha": 1.0}, "partition": {},
           "model": {"name": "logreg", "l2": 1e-4}, "seed": 0}
    calls = []

    def solve(value):
        def run():
            calls.append(value)
            return Reference(np.arange(3.0) * value, float(value), 1e-10)
        return run

    first = cached_reference(cfg, solve(1))
    again = cached_reference(cfg, solve(2))
    assert calls == [1] and again.f_star == 1.0 and np.array_equal(again.w_star, first.w_star)
    other = cached_reference({**cfg, "model": {"name": "logreg", "l2": 1e-3}}, solve(3))
    assert calls == [1, 3] and other.f_star == 3.0
    assert cached_reference({**cfg, "seed": 1}, solve(4)).f_star == 4.0
    assert not (tmp_path / "results").exists()  # never inside a results directory
