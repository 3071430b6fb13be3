"""make mutants' two-stage runs (mutation/forkserver.py): a mutant counts as killed only when a test failed, and as
alive only when every test of its module's selection passed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mutation"))
import forkserver  # noqa: E402  (a script's module, not a package)

SOURCE = '''import functools


class Grid:
    size = 2 + 1

    @functools.cache
    def step(self,
             scale=2 * 3):
        def inner(x):
            return x + 1
        return inner(scale)


def total(values):
    return sum(values) - 1
'''
CONFIG = {"args": ["-x", "-q", "tests/a.py", "-k", "fast"], "options": 2}


def fake_pytest(statuses: list[int], calls: list[list[str]]):
    """A stand-in for forkserver._pytest: returns `statuses` in turn and records the arguments of each run."""
    def run(server, conn, args):
        calls.append(list(args))
        return statuses[len(calls) - 1]
    return run


@pytest.mark.parametrize("statuses, status, stage, runs", [
    ([1], 1, "first", 1),  # a test that calls the function failed: killed, the rest not run
    ([0, 0], 0, "rest", 2),  # they passed, and so did the rest of the selection: alive
    ([0, 1], 1, "rest", 2),  # they passed, another test failed: killed
    ([0, forkserver.NO_TESTS], 0, "rest", 2),  # they were the whole selection: nothing left, alive (not killed)
    ([forkserver.NO_TESTS, 0], 0, "all", 2),  # the first stage found none of its tests: the whole selection ran
    ([forkserver.USAGE_ERROR, 1], 1, "all", 2),
])
def test_a_mutant_is_alive_only_when_the_whole_selection_passed(monkeypatch, statuses, status, stage, runs):
    calls: list[list[str]] = []
    monkeypatch.setattr(forkserver, "_pytest", fake_pytest(statuses, calls))
    assert forkserver._run_mutant(None, None, CONFIG, ["tests/a.py::test_fast_one"]) == (status, stage)
    assert len(calls) == runs
    assert calls[0] == ["-x", "-q", "tests/a.py::test_fast_one"]  # the options, then the first stage's tests
    if stage == "rest":
        assert calls[1] == [*CONFIG["args"], "--deselect", "tests/a.py::test_fast_one"]
    if stage == "all":
        assert calls[1] == CONFIG["args"]


def test_a_mutant_outside_any_function_runs_the_whole_selection_at_once(monkeypatch):
    calls: list[list[str]] = []
    monkeypatch.setattr(forkserver, "_pytest", fake_pytest([0], calls))
    assert forkserver._run_mutant(None, None, CONFIG, []) == (0, "all")
    assert calls == [CONFIG["args"]]


def test_each_body_line_maps_to_its_outermost_function_and_import_time_lines_to_none():
    lines = forkserver.functions_by_line(SOURCE)
    at = {text.strip(): lines.get(n) for n, text in enumerate(SOURCE.splitlines(), 1)}
    assert at["return x + 1"] == "Grid.step"  # a nested function's body: the test calls the method
    assert at["return inner(scale)"] == "Grid.step"
    assert at["return sum(values) - 1"] == "total"
    for run_at_import in ("size = 2 + 1", "@functools.cache", "def step(self,", "scale=2 * 3):", "def total(values):"):
        assert at[run_at_import] is None, run_at_import


def test_the_first_stage_is_the_tests_that_called_the_mutated_function(tmp_path):
    path = tmp_path / "grid.py"
    path.write_text(SOURCE)
    files = {str(path): SOURCE}
    bodies = {str(path): forkserver.functions_by_line(SOURCE)}
    calls = {f"{path}:total": ["t.py::test_b", "t.py::test_a"], f"{path}:Grid.step": ["t.py::test_c"]}
    assert forkserver._first_stage(files, bodies, calls) == []  # no change: no first stage
    path.write_text(SOURCE.replace("sum(values) - 1", "sum(values) + 1"))
    assert forkserver._first_stage(files, bodies, calls) == ["t.py::test_b", "t.py::test_a"]  # as recorded
    path.write_text(SOURCE.replace("size = 2 + 1", "size = 2 - 1"))
    assert forkserver._first_stage(files, bodies, calls) == []  # a class body runs at import: every test
