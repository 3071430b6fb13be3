"""memory_budget_gb: training and evaluation split into chunks that fit, with the unchunked result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from closeness import assert_close_to_scale
from fedharness.core.engine import Engine
from fedharness.errors import ConfigError
from fedharness.core.executors import InlineExecutor, entry_bytes
from fedharness.runs.execute import execute, prepare

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

STEPS_HIGH = 9


def _run(problem, algorithm, cfg, rounds: int):
    executor = InlineExecutor(problem, algorithm.solver)
    engine = Engine(problem, algorithm, executor, rounds=rounds, seed=cfg.seed, replicas=cfg.replicas,
                    eval_every=rounds)
    return engine.run().state, executor.shards[0]


def test_training_in_chunks_equals_one_batch(run_config):
    cfg = run_config("dataset.num_clients=12", "algorithm=scaffold", "algorithm.clients_per_round=6", "replicas=2",
                     "algorithm.local_work=random_steps", "algorithm.steps_low=1",
                     f"algorithm.steps_high={STEPS_HIGH}", "algorithm.client_lr=0.1", "dtype=float64")
    problem, algorithm, _ = prepare(cfg)
    problem.memory_budget = None
    whole, _ = _run(problem, algorithm, cfg, 3)
    copy = entry_bytes(problem, algorithm.solver, STEPS_HIGH)
    row = problem.dim * 8  # SCAFFOLD's c_i, float64, per (replica, client)
    problem.memory_budget = 2 * copy + 36 * row  # 2 copies beside the slots of 24 pairs and 12 new ones
    chunked, shard = _run(problem, algorithm, cfg, 3)
    held = len(shard.store.tables["control"].rows) * row  # the c_i rows kept after 3 rounds (at most 2 x 12)
    assert 0 < held <= 24 * row and shard.store.nbytes == held
    # the slots the 12 entries may hold are left out of the step's room: 12 sampled copies go in 6 chunks or more
    assert shard.chunk_entries(STEPS_HIGH, 12) == (problem.memory_budget - held - 12 * row) // copy >= 2
    assert problem.memory_budget // copy > 2  # the budget alone would have held more copies
    assert_close_to_scale(chunked.x, whole.x, rtol=1e-12)
    assert_close_to_scale(chunked.server_ctx["control"], whole.server_ctx["control"], rtol=1e-12)
    assert chunked.x.abs().max() > 1e-2  # the model moved


@pytest.mark.parametrize("model", ["logreg", "2nn"])
def test_evaluation_in_chunks_equals_one_chunk(run_config, model):
    cfg = run_config("dataset.num_clients=8", f"model={model}", "model.l2=0.01", "dtype=float64")
    problem, _, _ = prepare(cfg)
    # a random offset: at init + 0.01 every class of a linear model has the same logit, and which one argmax takes
    # (test_acc) is decided by the last bits of the logits, which differ between chunk sizes under MKL_CBWR=COMPATIBLE
    w = problem.init_params(3, 0) + 0.01 * torch.randn(3, problem.dim, generator=torch.Generator().manual_seed(0),
                                                       dtype=torch.float64)
    problem.memory_budget = None
    whole = problem.evaluate(w)
    item = 8
    problem.memory_budget = 3 * 7 * (problem.sample_numel * item + problem.objective.activation_bytes(1, item))
    assert problem.eval_chunk(3) == 7 and len(problem.y) > 100  # many chunks of 7 samples
    chunked = problem.evaluate(w)
    for name in ("train_loss", "grad_norm_sq", "test_loss", "test_acc"):
        assert_close_to_scale(getattr(chunked, name), getattr(whole, name), rtol=1e-12)


def test_budget_too_small_for_one_client_is_one_clear_error(run_config, tmp_path):
    cfg = run_config("dataset.num_clients=4", "memory_budget_gb=1e-9", f"results_dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError) as err:
        execute(cfg)
    assert err.value.key == "memory_budget_gb" and "one client copy" in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        execute(run_config("memory_budget_gb=-1"))


def test_activation_estimate_probes_on_the_nets_device():
    """The probe sample goes where the net lives: on CUDA the estimate once failed at the first chunk (a CPU
    sample into CUDA weights). The meta device stands in for CUDA here: the probe must not mix devices, and the
    layer outputs it counts (shapes only) equal the CPU count."""
    from fedharness.problems.nets import build_net
    from fedharness.problems.objectives import ACTIVATION_FACTOR, NetObjective, _leaf_outputs

    objective = NetObjective(build_net("cnn", (1, 28, 28), 10), "cnn", 0.0, (1, 28, 28))
    cpu_outputs = _leaf_outputs(objective.net, objective.inputs(1))
    objective.net.to("meta")
    assert objective.activation_bytes(2, 4) >= 2 * 4 * ACTIVATION_FACTOR * cpu_outputs > 0


def test_vmap_probe_runs_on_the_nets_device():
    """The vmap probe's sample goes where the net lives: on CUDA a CPU sample into CUDA weights once failed the
    probe, so every CUDA net was taken for one vmap cannot run (kernel=loop only, 7x slower rounds for ResNet-18
    at K = 50 on an H200, and the loop executor refused as for a stochastic net). The meta device stands in for
    CUDA (autocast has no meta backend, so the probe's gradient is recorded, not run)."""
    from fedharness.problems.nets import build_net
    from fedharness.problems.objectives import NetObjective

    objective = NetObjective(build_net("resnet18", (3, 32, 32), 10), "resnet18", 0.0, (3, 32, 32))
    seen = []
    objective._grad = lambda params, buffers, masks, x, y: seen.extend(
        [*(t.device.type for t in (*params.values(), *buffers.values(), *masks)), x.device.type, y.device.type])
    objective.net.to("meta")
    assert objective.vmappable and set(seen) == {"meta"}
