"""Tests that kill mutants `make mutants` found alive (docs/mutation.md lists each survivor and its test)."""

from __future__ import annotations

from fedharness.algorithms import accounting


def test_a_run_of_no_rounds_spends_nothing_in_a_composition_even_without_noise():
    """A trial pruned before its first round released nothing: it adds nothing to what a study spent, even at z = 0
    (alone, z = 0 is an infinite epsilon). Kills `rounds >= 0` for `rounds > 0` in composed_epsilon."""
    alone = accounting.epsilon("rdp", 0.1, 1.0, 10, 1e-5)
    assert accounting.composed_epsilon("rdp", [(0.1, 0.0, 0), (0.1, 1.0, 10)], 1e-5) == alone
    assert accounting.composed_epsilon("rdp", [(0.1, 0.0, 0)], 1e-5) == 0.0
