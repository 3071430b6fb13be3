"""kernel=auto when two processes miss the cache together: one measures, the other waits for its choice (a lock
beside the cache), so runs started together choose alike and give the same bits."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pyarrow.dataset as ds
import pytest

from fedharness.config.load import load_settings
from fedharness.core import kernels
from fedharness.runs.execute import execute, prepare  # imported before the fork: the children start at once

RUN = ["dataset=digits", "model=2nn", "rounds=2", "eval_every=1", "progress=false", "threads=1", "reference=off",
       "kernel=auto"]


def rows_and_kernel(results_dir) -> tuple[list[tuple], str]:
    """The run's rounds rows (every value) and the kernel its runs/ row records."""
    rounds = ds.dataset(results_dir / "rounds", format="parquet").to_table().to_pylist()
    run, = ds.dataset(results_dir / "runs", format="parquet").to_table().to_pylist()
    return sorted(tuple(sorted((k, v) for k, v in r.items() if k not in ("run_id", "wall_s"))) for r in rounds), \
        json.loads(run["config_json"])["kernel"]


class NoisyMeasure:
    """kernels.measure made slow (the other process misses the cache meanwhile) and noisy: each measurement
    reverses the last one's order, as two close formulations on a busy machine do. Counts the measurements across
    forked processes."""

    def __init__(self, fork):
        self.fork = fork  # the processes' context
        self.count = fork.Value("i", 0)

    def __call__(self, objective, copies, batch, device, dtype, names=None) -> dict[str, float]:
        with self.count.get_lock():
            self.count.value += 1
            first = self.count.value % 2 == 1
        time.sleep(0.3)
        return {"vmap": 1e-3, "loop": 2e-3} if first else {"vmap": 2e-3, "loop": 1e-3}


def together(fork, target, *args) -> None:
    """`target(barrier, i, *args)` in two forked processes (they share the patched measure and the imports),
    released together by a barrier; both must exit 0."""
    barrier = fork.Barrier(2)
    children = [fork.Process(target=target, args=(barrier, i, *args)) for i in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(timeout=150)
    assert [child.exitcode for child in children] == [0, 0]


def resolve_after(barrier, i, settings, problem, chosen) -> None:
    barrier.wait(timeout=60)
    chosen[i] = kernels.KERNELS.index(kernels.resolve_kernel(settings, problem))
    os._exit(0)


def run_after(barrier, i, results_dir) -> None:
    settings = load_settings([f"results_dir={results_dir / str(i)}", *RUN])
    barrier.wait(timeout=60)
    os._exit(0 if execute(settings).status == "ok" else 1)


@pytest.fixture
def noisy(tmp_path, monkeypatch) -> NoisyMeasure:
    """kernels.measure noisy and counted, for forked processes; a fresh cache."""
    measure = NoisyMeasure(multiprocessing.get_context("fork"))
    monkeypatch.setattr(kernels, "measure", measure)
    monkeypatch.setenv("FEDHARNESS_CACHE", str(tmp_path / "cache"))
    return measure


@pytest.mark.timeout(180)
def test_two_processes_missing_the_cache_together_measure_once_and_choose_alike(noisy, tmp_path):
    """Without the lock both measure, and (the noise) choose differently."""
    problem, _, _ = prepare(load_settings([f"results_dir={tmp_path}", *RUN, "kernel=loop"]))
    chosen = noisy.fork.Array("i", [-1, -1])
    together(noisy.fork, resolve_after, load_settings([f"results_dir={tmp_path}", *RUN]), problem, chosen)
    assert noisy.count.value == 1
    assert [kernels.KERNELS[c] for c in chosen] == ["vmap", "vmap"]
    remembered = json.loads((tmp_path / "cache" / "kernels.json").read_text())
    assert [entry["kernel"] for entry in remembered.values()] == ["vmap"]


@pytest.mark.slow  # two runs in parallel: ~6 s on the loaded 2-core machine, after the imports
@pytest.mark.timeout(300)
def test_two_kernel_auto_runs_started_together_give_the_same_bits(noisy, tmp_path):
    together(noisy.fork, run_after, tmp_path)
    assert noisy.count.value == 1
    (rows_a, kernel_a), (rows_b, kernel_b) = rows_and_kernel(tmp_path / "0"), rows_and_kernel(tmp_path / "1")
    assert kernel_a == kernel_b == "vmap" and len(rows_a) == 3
    assert rows_a == rows_b
