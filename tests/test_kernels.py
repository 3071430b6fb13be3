"""kernel: vmap | loop | loop_channels_last compute the same client gradients and runs; auto times them once
per shape, takes the fastest, remembers it (later runs repeat), keeps a resumed run's choice, and the runs/ row
records it."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from closeness import assert_close_to_scale
from fakes import fake_mnist
from fedharness.core import kernels
from fedharness.core.checkpoint import checkpointed
from fedharness.contracts import ClientKeys
from fedharness.runs.execute import execute, prepare, prepare_run
from fedharness.config.schema import TOP

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def _prepared(settings) -> tuple[dict, object]:
    """prepare(settings); and the config the run records, its kernel resolved (prepare used to write it into a
    config dict in place: settings are frozen)."""
    run = prepare_run(settings)
    return run.settings.config, run.problem


def _cnn(run_config, tmp_path, *extra: str):
    fake_mnist(tmp_path / "mnist" / "MNIST" / "raw", 120, 20, gz=False)
    return run_config("dataset=mnist", f"dataset.data_dir={tmp_path / 'mnist'}", "dataset.num_clients=6",
                      "model=cnn", "algorithm.clients_per_round=3", "algorithm.local_steps=3",
                      "algorithm.batch_size=8", "algorithm.client_lr=0.05", "rounds=2", "dtype=float64", *extra)


def _gradients(problem, kernel: str) -> torch.Tensor:
    """One minibatch gradient of 4 distinct client copies (the weights differ per copy)."""
    problem.objective.kernel = kernel
    w = problem.init_params(4, 0)
    keys = ClientKeys(np.arange(4), np.zeros(4, dtype=np.int64), 0, 0)
    return problem.grad(w, problem.round_batches(keys, 1), 0)


def test_every_kernel_gives_the_vmap_gradient(run_config, tmp_path):
    problem, _, _ = prepare(_cnn(run_config, tmp_path))
    vmapped = _gradients(problem, "vmap")
    assert vmapped.abs().max() > 1e-3 and not torch.equal(vmapped[0], vmapped[1])  # real, per-copy gradients
    for kernel in ("loop", "loop_channels_last"):
        assert_close_to_scale(_gradients(problem, kernel), vmapped, rtol=1e-12)


def test_a_loop_run_follows_the_vmap_run(run_config, tmp_path):
    runs = {k: execute(_cnn(run_config, tmp_path, f"kernel={k}", "eval_every=1")) for k in ("vmap", "loop")}
    losses = {k: np.array([r["train_loss"] for r in run.rows]) for k, run in runs.items()}
    assert len(losses["vmap"]) == 3 and np.ptp(losses["vmap"]) > 1e-3  # the rounds move the model
    assert_close_to_scale(losses["loop"], losses["vmap"], rtol=1e-10)


def test_auto_measures_once_and_the_runs_row_records_the_choice(run_config, tmp_path, monkeypatch, caplog):
    caplog.set_level("INFO", logger="fedharness")  # the CLI shows it on stderr (fedharness.cli)
    monkeypatch.setenv("FEDHARNESS_CACHE", str(tmp_path / "cache"))
    result = execute(_cnn(run_config, tmp_path, "progress=true"))
    row = pq.read_table(tmp_path / "results" / "runs" / f"run_id={result.run_id}").to_pylist()[0]
    chosen = json.loads(row["config_json"])["kernel"]
    remembered = json.loads((tmp_path / "cache" / "kernels.json").read_text())
    assert [entry["kernel"] for entry in remembered.values()] == [chosen]
    assert set(next(iter(remembered.values()))["ms"]) == {"vmap", "loop", "loop_channels_last"}  # a CNN: no fused
    assert f"kernel=auto chose {chosen} (ms per batched gradient of 3 copies: vmap " in caplog.text
    monkeypatch.setattr(kernels, "measure", lambda *a: pytest.fail("measured the same shapes again"))
    again, _ = _prepared(_cnn(run_config, tmp_path))
    assert again["kernel"] == chosen


def test_measure_times_each_candidate_and_leaves_the_kernel(run_config, tmp_path):
    problem, _, _ = prepare(_cnn(run_config, tmp_path, "kernel=loop"))
    timings = kernels.measure(problem.objective, 2, 4, problem.device, problem.dtype)
    assert list(timings) == ["vmap", "loop", "loop_channels_last"]  # the CNN has convolutions
    assert all(0 < s < 60 for s in timings.values()) and problem.objective.kernel == "loop"
    mlp, _, _ = prepare(run_config("dataset=digits", "model=2nn", "rounds=1"))
    assert kernels.candidates(mlp.objective) == ("vmap", "loop")  # no 4-D weights: no channels-last


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """auto with given timings (loop fastest) and an empty cache; records the copies of each measurement."""
    calls = []

    def fake_measure(objective, copies, batch, device, dtype, names=None):
        calls.append(copies)
        return {"vmap": 3e-3, "loop": 1e-3, "loop_channels_last": 2e-3}

    monkeypatch.setattr(kernels, "measure", fake_measure)
    monkeypatch.setenv("FEDHARNESS_CACHE", str(tmp_path / "cache"))
    return calls


def test_auto_takes_the_fastest_for_the_copies_of_a_round(run_config, tmp_path, timed, caplog):
    caplog.set_level("INFO", logger="fedharness")
    cfg, problem = _prepared(_cnn(run_config, tmp_path, "progress=true", "replicas=2"))
    assert cfg["kernel"] == "loop" and problem.objective.kernel == "loop"
    assert timed == [6]  # 3 sampled clients x 2 replicas
    assert "kernel=auto chose loop (ms per batched gradient of 6 copies: vmap 3, loop 1, " in caplog.text
    prepare(_cnn(run_config, tmp_path, "dataset.num_clients=8", "algorithm.clients_per_round=8"))
    assert timed == [6, 8]  # other shapes are timed anew


def test_the_shard_count_does_not_change_autos_choice(run_config, tmp_path, timed):
    """CI once saw 1 and 3 shards differ in the last bits: each timed its own copies per shard and the noisy
    timings chose vmap for one and loop for the other."""
    for shards in (["num_shards=1"], ["num_shards=3"], ["executor=ray", "ray.num_shards=2"]):
        cfg, _ = _prepared(_cnn(run_config, tmp_path, "replicas=2", *shards))
        assert cfg["kernel"] == "loop"
    assert timed == [6]  # measured once: the other shard counts found the same entry


def test_the_thread_count_does_not_change_autos_choice(run_config, tmp_path, timed):
    """threads: null follows the load at a run's start: a run on another count reuses the choice (issue 47)."""
    try:
        for threads in (1, 2):
            cfg, _ = _prepared(_cnn(run_config, tmp_path, f"threads={threads}"))
            assert cfg["kernel"] == "loop" and cfg["threads"] == threads == torch.get_num_threads()
    finally:
        torch.set_num_threads(1)  # the tests' setting (conftest)
    assert timed == [3]  # measured once, at 1 thread


def test_an_explicit_or_resumed_kernel_is_not_measured(run_config, tmp_path, timed):
    cfg = _cnn(run_config, tmp_path, "kernel=loop_channels_last")
    problem, _, _ = prepare(cfg)
    assert problem.objective.kernel == "loop_channels_last" and timed == []
    auto = _cnn(run_config, tmp_path)
    assert kernels.resolve_kernel(auto, problem, resumed_kernel="vmap") == "vmap"
    auto = auto.replace(kernel=problem.objective.kernel).config  # what prepare_run records (settings are frozen)
    assert problem.objective.kernel == "vmap" and auto["kernel"] == "vmap" and timed == []


def test_an_unwritable_cache_costs_only_a_measurement(run_config, tmp_path, timed, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FEDHARNESS_CACHE", str(tmp_path / "file" / "cache"))
    for _ in range(2):
        cfg, _ = _prepared(_cnn(run_config, tmp_path))
        assert cfg["kernel"] == "loop"
    assert timed == [3, 3]


def test_a_checkpoint_records_the_kernel_for_resume(run_config, tmp_path):
    result = execute(_cnn(run_config, tmp_path, "kernel=loop", "checkpoint_every=1"))
    cfg = _cnn(run_config, tmp_path, f"resume={result.run_id}")
    assert checkpointed(cfg, "kernel") == "loop"
    assert checkpointed(_cnn(run_config, tmp_path, "resume=nosuch"), "kernel") is None


def test_the_schema_offers_exactly_the_kernels():
    key = TOP["kernel"]
    assert key.check("auto") and all(key.check(k) for k in kernels.KERNELS) and not key.check("grouped")
