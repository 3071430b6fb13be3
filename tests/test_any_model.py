"""Any torch module: BatchNorm buffers and dropout train, average or stay local (FedBN), shard and resume exactly.

The ResNet-18 with BatchNorm is checked in float64 (in float32, BatchNorm over 4 samples of 1x1 maps in its last
stage amplifies rounding to 1e-3 in one round) against a plain torch loop written here: every client a torch module
trained by SGD on the minibatches the run's streams name, the server the p_k-weighted mean of the clients'
parameters and buffers. Dropout nets are checked for the same trajectory on any number of shards, on both
kernels and after a resume.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore
from torch import nn

import fedharness
from fedharness.backends.ray_executor import RayExecutor
from fedharness.base import streams
from fedharness.core.client_store import checkpointed_values
from fedharness.core.executors import InlineExecutor
from fedharness.results.store import open_store
from fedharness.assembly.build import build_parts
from fedharness.problems.module_state import DropoutSite, draw_masks
from fedharness.problems import MODELS
from fedharness.problems.nets import build_net
from fedharness.runs.execute import execute
from ray_support import max_rel_diff, read_rounds, trajectory

ROUNDS, STEPS, BATCH, LR = 2, 2, 4, 0.05
DIGITS = ["dataset=digits", "dataset.num_clients=3", "algorithm.sampler=full", f"algorithm.batch_size={BATCH}",
          f"algorithm.local_steps={STEPS}", f"algorithm.client_lr={LR}", f"rounds={ROUNDS}", "eval_every=1",
          "heterogeneity=false"]


class BNDropNet(nn.Module):
    """Conv - BatchNorm2d - Dropout2d - fc - BatchNorm1d - Dropout - fc: both kinds of buffers and of dropout."""

    def __init__(self, in_shape, num_classes, p=0.3, functional=False):
        super().__init__()
        c, h, w = in_shape
        self.functional = functional
        self.conv = nn.Conv2d(c, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.drop2d = nn.Dropout2d(p)
        self.fc1 = nn.Linear(4 * h * w, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(16, num_classes)
        self.p = p

    def forward(self, x):
        x = self.drop2d(F.relu(self.bn(self.conv(x))))
        x = F.relu(self.bn1(self.fc1(x.flatten(1))))
        # functional=True: randomness torch.func.vmap cannot batch, so the per-client path runs the module
        x = F.dropout(x, self.p, self.training) if self.functional else self.drop(x)
        return self.fc2(x)


@pytest.fixture
def bn_net():
    """`bn_drop` registered for the test, the registries restored afterwards."""
    saved = dict(MODELS)
    repo = ConfigStore.instance().repo
    stored = set(repo.get("model", {}))
    fedharness.register_model("bn_drop", BNDropNet, p=0.3, functional=False)
    yield "bn_drop"
    MODELS.clear()
    MODELS.update(saved)
    for name in set(repo.get("model", {})) - stored:
        del repo["model"][name]




# --- the plain torch loop --------------------------------------------------------------------------------------


def _state_tensors(net: nn.Module) -> list[torch.Tensor]:
    """The flat layout fedharness documents: parameters, then floating-point buffers, in module order."""
    return [*net.parameters(), *(b for b in net.buffers() if b.is_floating_point())]


def _load(net: nn.Module, flat: torch.Tensor) -> None:
    start = 0
    for t in _state_tensors(net):
        t.data.copy_(flat[start:start + t.numel()].view_as(t))
        start += t.numel()


def _flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in _state_tensors(net)])


def torch_fedavg(net: nn.Module, problem, x0: torch.Tensor, seed: int, local: bool = False):
    """FedAvg, every client every round, plain SGD in torch; local=True: each client keeps its own buffers.
    The server's parameters and buffers, and each client's buffers as it ended its last round."""
    n_params = sum(p.numel() for p in net.parameters())
    server, own = x0.clone(), {}
    offsets = np.concatenate([[0], np.cumsum(problem.sizes)[:-1]])
    for rnd in range(ROUNDS):
        clients = []
        for k in range(problem.num_clients):
            _load(net, server)
            if local and k in own:
                _load(net, torch.cat([server[:n_params], own[k]]))
            net.train()
            key = streams.stream_key(seed, streams.BATCH, 0, rnd, k)
            index = streams.integers(key, STEPS * BATCH, problem.sizes[k]).reshape(STEPS, BATCH) + offsets[k]
            for t in range(STEPS):
                idx = torch.as_tensor(index[t])
                loss = F.cross_entropy(net(problem.x[idx]), problem.y[idx])
                grads = torch.autograd.grad(loss, list(net.parameters()))
                with torch.no_grad():
                    for p, g in zip(net.parameters(), grads):
                        p -= LR * g
            clients.append(_flat(net))
            own[k] = clients[-1][n_params:].clone()
        server = sum(float(p) * c.double() for p, c in zip(problem.weights, clients)).to(x0.dtype)
    return server, own


def _check_against_torch(got: torch.Tensor, want: torch.Tensor, x0: torch.Tensor, n_params: int, tol: float):
    for part in (slice(0, n_params), slice(n_params, None)):  # parameters, then buffers
        assert max_rel_diff(got[None, part], want[None, part]) < tol
        assert (want[part] - x0[part]).norm() > 1e-3 * x0[part].norm()  # it moved: the comparison means something


def test_resnet18_bn_is_resnet18_with_batchnorm():
    net = build_net("resnet18_bn", (3, 32, 32), 10)
    assert sum(p.numel() for p in net.parameters()) == 11_173_962  # as the GroupNorm ResNet-18 and the papers
    norms = [m for m in net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 20 and not any(isinstance(m, nn.GroupNorm) for m in net.modules())
    assert sum(b.numel() for b in net.buffers() if b.is_floating_point()) == 2 * sum(m.num_features for m in norms)


@pytest.mark.slow  # 10-15 s each: ResNet-18 on the CPU
@pytest.mark.parametrize("kernel", ["vmap", "loop"])
def test_resnet18_bn_matches_a_plain_torch_loop(run_config, kernel):
    cfg = run_config(*DIGITS, "model=resnet18_bn", f"kernel={kernel}", "dtype=float64")
    problem, algorithm = build_parts(cfg)
    assert problem.objective.kernel == kernel and problem.objective.buffer_dim == 9600
    xs, _ = trajectory(cfg, InlineExecutor(problem, algorithm.solver), ROUNDS, problem, algorithm)
    net = build_net("resnet18_bn", tuple(problem.x.shape[1:]), 10).double()
    want, _ = torch_fedavg(net, problem, xs[0, 0], cfg.seed)
    _check_against_torch(xs[-1, 0], want, xs[0, 0], problem.objective.param_dim, 1e-9)


@pytest.mark.slow
def test_resnet18_bn_on_two_ray_shards_matches_the_torch_loop(local_ray, run_config):
    cfg = run_config(*DIGITS, "model=resnet18_bn", "kernel=vmap", "dtype=float64", "executor=ray", "ray.num_shards=2")
    problem, algorithm = build_parts(cfg)
    executor = RayExecutor(cfg, problem, algorithm.solver)
    try:
        xs, _ = trajectory(cfg, executor, ROUNDS, problem, algorithm)
        assert len(executor.shard_nodes()) == 2
    finally:
        executor.close()
    net = build_net("resnet18_bn", tuple(problem.x.shape[1:]), 10).double()
    want, _ = torch_fedavg(net, problem, xs[0, 0], cfg.seed)
    _check_against_torch(xs[-1, 0], want, xs[0, 0], problem.objective.param_dim, 1e-9)


def test_local_buffers_are_each_clients_own_fedbn(run_config, bn_net):
    cfg = run_config(*DIGITS, f"model={bn_net}", "model.p=0.0", "model.buffers=local", "dtype=float64")
    problem, algorithm = build_parts(cfg)
    executor = InlineExecutor(problem, algorithm.solver, 2)
    xs, _ = trajectory(cfg, executor, ROUNDS, problem, algorithm)
    net = BNDropNet(tuple(problem.x.shape[1:]), 10, p=0.0).double()
    want, own = torch_fedavg(net, problem, xs[0, 0], cfg.seed, local=True)
    _check_against_torch(xs[-1, 0], want, xs[0, 0], problem.objective.param_dim, 1e-10)
    kept = executor.get_state()  # the clients' own buffers live in the shards' client state
    assert sorted(kept) == [(0, k) for k in range(3)]
    n_params = problem.objective.param_dim
    for k in range(3):
        assert max_rel_diff(kept[(0, k)]["buffers"][None], own[k][None]) < 1e-10
        # the client's own statistics, not the server's average (which the global model is evaluated with)
        assert max_rel_diff(kept[(0, k)]["buffers"][None], want[None, n_params:]) > 1e-3
    _, averaged_own = torch_fedavg(net, problem, xs[0, 0], cfg.seed, local=False)
    assert max_rel_diff(own[0][None], averaged_own[0][None]) > 1e-6  # local: round 2 started from the client's own


# --- dropout --------------------------------------------------------------------------------------------------


def test_dropout_masks_depend_on_the_copys_seed_only():
    sites = [DropoutSite(nn.Dropout(0.25), 0.25, (50,)), DropoutSite(nn.Dropout2d(0.5), 0.5, (6, 1, 1))]
    both = draw_masks(sites, np.array([11, 12]), 40, torch.float64, torch.device("cpu"))
    alone = draw_masks(sites, np.array([12]), 40, torch.float64, torch.device("cpu"))
    for pair, single, site in zip(both, alone, sites):
        assert torch.equal(pair[1], single[0]) and not torch.equal(pair[0], pair[1])
        kept = pair != 0
        assert torch.all(pair[kept] == 1 / (1 - site.p))  # survivors are scaled by 1/(1-p)
        assert abs(kept.double().mean().item() - (1 - site.p)) < 0.08


def _dropout_trajectory(run_config, model: str, shards: int, *extra: str) -> torch.Tensor:
    cfg = run_config(*DIGITS, f"model={model}", "dtype=float64", *extra)
    problem, algorithm = build_parts(cfg)
    xs, _ = trajectory(cfg, InlineExecutor(problem, algorithm.solver, shards), ROUNDS, problem, algorithm)
    return xs


def test_dropout_trajectory_is_the_same_on_one_or_three_shards_and_both_kernels(run_config, bn_net):
    one = _dropout_trajectory(run_config, bn_net, 1, "kernel=vmap")
    assert max_rel_diff(_dropout_trajectory(run_config, bn_net, 3, "kernel=vmap"), one) < 1e-12
    assert max_rel_diff(_dropout_trajectory(run_config, bn_net, 3, "kernel=loop"), one) < 1e-10
    without = _dropout_trajectory(run_config, bn_net, 1, "kernel=vmap", "model.p=0.0")
    assert max_rel_diff(without, one) > 1e-3  # dropout is on: it changes the trajectory


def test_a_module_vmap_cannot_run_trains_per_client_said_once(run_config, bn_net, caplog):
    caplog.set_level(logging.WARNING, logger="fedharness.problems.objectives")
    one = _dropout_trajectory(run_config, bn_net, 1, "model.functional=true")
    assert caplog.text.count("torch.func.vmap cannot run its training step") == 1
    assert "train one copy at a time (kernel=loop)" in caplog.text
    three = _dropout_trajectory(run_config, bn_net, 3, "model.functional=true", "kernel=vmap")
    assert max_rel_diff(three, one) < 1e-12  # F.dropout draws from torch's generator seeded per copy and step
    assert max_rel_diff(_dropout_trajectory(run_config, bn_net, 1, "model.p=0.0"), one) > 1e-3


def test_resume_with_dropout_and_local_buffers_is_bit_identical(tmp_path, run_config, bn_net):
    run = [*DIGITS, f"model={bn_net}", "model.buffers=local", "rounds=5", "checkpoint_every=2",
           "algorithm.sampler=scheme_i", "algorithm.clients_per_round=2", "replicas=2"]
    execute(run_config(*run, f"results_dir={tmp_path / 'whole'}"), run_id="whole")

    def crash(rows, state):
        if state.round == 3:
            raise RuntimeError("driver crashed")

    with pytest.raises(RuntimeError, match="driver crashed"):
        execute(run_config(*run, f"results_dir={tmp_path / 'cut'}"), run_id="victim", on_eval=crash)
    state = torch.load(tmp_path / "cut" / "checkpoints" / "run_id=victim" / "state.pt", weights_only=True)
    kept = checkpointed_values(open_store(str(tmp_path / "cut")), state["client_files"])  # the shards' own files
    assert state["round"] == 2 and kept and all("buffers" in s for s in kept.values())
    execute(run_config(*run, f"results_dir={tmp_path / 'cut'}", "resume=victim"))
    got, want = read_rounds(tmp_path / "cut", "victim"), read_rounds(tmp_path / "whole", "whole")
    assert [(r["round"], r["replica"]) for r in got] == [(r["round"], r["replica"]) for r in want]
    assert len(want) == 2 * 6 and not math.isclose(want[0]["train_loss"], want[-1]["train_loss"])
    for g, w in zip(got, want):
        for name in ("train_loss", "grad_norm_sq", "test_loss", "test_acc"):
            assert g[name] == w[name], (name, g, w)  # the same bits


def test_a_batchnorm_without_momentum_is_refused_by_name(run_config, bn_net):
    fedharness.register_model("cma", lambda in_shape, num_classes: nn.Sequential(
        nn.Flatten(), nn.Linear(math.prod(in_shape), 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, num_classes)))
    with pytest.raises(fedharness.ConfigError, match=r"'model': 'cma'.*momentum=None"):
        build_parts(run_config(*DIGITS, "model=cma"))
