"""precision (fp32 | tf32 | bf16) and deterministic: the flags reach torch, bf16 trains close to fp32 with
float32 weights, a deterministic run repeats bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fakes import fake_mnist
from fedharness.errors import ConfigError
from fedharness.contracts import ClientKeys
from fedharness.runs.execute import execute
from fedharness.base.runtime import apply_runtime
from quadratic_runs import run_engine


@pytest.fixture
def restore_torch_flags():
    yield
    apply_runtime()  # defaults: fp32, not deterministic


def _cnn_config(run_config, tmp_path, *extra: str):
    fake_mnist(tmp_path / "mnist" / "MNIST" / "raw", 120, 20, gz=False)
    return run_config("dataset=mnist", f"dataset.data_dir={tmp_path / 'mnist'}", "dataset.num_clients=6",
                      "model=cnn", "algorithm.clients_per_round=3", "algorithm.local_steps=3",
                      "algorithm.batch_size=8", "algorithm.client_lr=0.05", "rounds=3", *extra)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 7 s idle
def test_bf16_trains_near_fp32_with_float32_weights(run_config, tmp_path):
    fp32 = run_engine(_cnn_config(run_config, tmp_path))
    bf16 = run_engine(_cnn_config(run_config, tmp_path, "precision=bf16"))
    assert bf16.outcome.state.x.dtype == torch.float32
    assert bf16.problem.objective.autocast == torch.bfloat16
    x32, x16 = fp32.outcome.state.x, bf16.outcome.state.x
    assert not torch.equal(x32, x16)  # autocast really ran in bfloat16
    loss32, loss16 = fp32.outcome.rows[-1]["train_loss"], bf16.outcome.rows[-1]["train_loss"]
    assert abs(loss16 - loss32) < 0.05 * loss32
    # one minibatch gradient of 3 clients at the start: bf16 keeps its direction (measured: cos >= 0.997,
    # relative error 4-8%), a wrong cast or a dropped term would not
    w = fp32.problem.init_params(1, 0).repeat(3, 1)
    keys = ClientKeys(np.arange(3), np.zeros(3, dtype=np.int64), 0, 0)
    g32, g16 = (run.problem.grad(w, run.problem.round_batches(keys, 1), 0) for run in (fp32, bf16))
    assert g16.dtype == torch.float32
    assert (torch.nn.functional.cosine_similarity(g16, g32, dim=1) > 0.99).all()
    assert ((g16 - g32).norm(dim=1) < 0.2 * g32.norm(dim=1)).all()


@pytest.mark.parametrize("precision,tf32", [("tf32", True), ("fp32", False), ("bf16", False)])
def test_precision_sets_the_tf32_flags(precision, tf32, restore_torch_flags):
    apply_runtime(precision)
    assert torch.backends.cuda.matmul.allow_tf32 is tf32 and torch.backends.cudnn.allow_tf32 is tf32


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_deterministic_run_is_on_inside_the_run_and_repeats_bit_for_bit(run_config, tmp_path,
                                                                         restore_torch_flags):
    seen = []
    cfg = _cnn_config(run_config, tmp_path, "deterministic=true", "eval_every=1", "replicas=2")
    runs = [execute(cfg, on_eval=lambda rows, state: seen.append(torch.are_deterministic_algorithms_enabled()))
            for _ in range(2)]
    assert seen and all(seen) and not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    losses = [np.array([r["train_loss"] for r in run.rows]) for run in runs]
    assert np.array_equal(losses[0], losses[1]) and len(losses[0]) == 8  # 4 evaluations x 2 replicas


@pytest.mark.parametrize("key,value", [("precision", "fp16"), ("deterministic", "yes"), ("memory_budget_gb", 0)])
def test_bad_runtime_keys_are_one_clear_error(run_config, key, value):
    with pytest.raises(ConfigError) as err:
        execute(run_config(f"{key}={value}"))
    assert err.value.key == key
