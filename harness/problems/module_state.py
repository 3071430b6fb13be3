"""A torch module's trainable state as one flat vector per client copy, and its dropout driven by seeds.

Flat layout of a copy: the parameters (named_parameters order), then the floating-point buffers (named_buffers
order: BatchNorm's running_mean and running_var). Local steps move the parameters by gradients; the buffers'
new values come from the train-mode forward pass of each step (the executor writes them in, harness/core/
buffers.py), and the server averages them with the round's aggregation coefficients. Integer buffers
(BatchNorm's num_batches_tracked) are not part of the state: every forward pass gets a fresh copy of the
module's own value, so they never change. A BatchNorm that needs them (momentum=None, a cumulative average) is
refused.

Dropout: the masks of the nn.Dropout modules (Dropout, Dropout1d/2d/3d) are drawn outside the model, per client
copy and local step, from a torch generator seeded by the counter-based streams (harness/base/streams.py, keyed by
seed, replica, round, client and step), then handed to the modules while the vmapped (or per-client) forward runs.
So a copy's masks do not depend on which shard trains it or on a resume.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import nn

from fedharness.errors import ConfigError

CHANNEL_DROPOUT = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)  # one draw per (sample, channel)


class ModuleLayout:
    """Names and shapes of a module's parameters and float buffers, and the split of a flat vector into them."""

    def __init__(self, net: nn.Module, name: str):
        for module_name, m in net.named_modules():
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.momentum is None:
                raise ConfigError("model", name, f"module '{module_name}' is a BatchNorm with momentum=None (a "
                                  "cumulative average over num_batches_tracked); give it a momentum, e.g. 0.1")
        self.names = [n for n, _ in net.named_parameters()]
        self.shapes = [p.shape for _, p in net.named_parameters()]
        self.numels = [p.numel() for _, p in net.named_parameters()]
        buffers = [(n, b) for n, b in net.named_buffers()]
        self.buffer_names = [n for n, b in buffers if b.is_floating_point()]
        self.buffer_shapes = [b.shape for _, b in buffers if b.is_floating_point()]
        self.constants = {n: b.detach().clone() for n, b in buffers if not b.is_floating_point()}
        self.param_dim = sum(self.numels)
        self.buffer_dim = sum(int(np.prod(s)) for s in self.buffer_shapes)

    def split(self, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Parameters and float buffers of flat vectors w [..., dim], as views shaped like the module's."""
        lead = w.shape[:-1]
        sizes = [*self.numels, *(int(np.prod(s)) for s in self.buffer_shapes)]
        parts = torch.split(w, sizes, dim=-1)
        names, shapes = [*self.names, *self.buffer_names], [*self.shapes, *self.buffer_shapes]
        tensors = {n: p.reshape(*lead, *s) for n, p, s in zip(names, parts, shapes)}
        return ({n: tensors[n] for n in self.names}, {n: tensors[n] for n in self.buffer_names})

    def flat_buffers(self, buffers: dict[str, torch.Tensor], lead: int | None) -> list[torch.Tensor]:
        """The buffers' values in layout order, each flattened (per copy when `lead` is the number of copies)."""
        return [buffers[n].reshape(-1) if lead is None else buffers[n].reshape(lead, -1) for n in self.buffer_names]

    def module_state(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict:
        """What functional_call takes: parameters, fresh copies of the buffers (a train-mode forward updates them
        in place) and fresh copies of the integer constants."""
        state = dict(params)
        state.update({n: b.clone() for n, b in buffers.items()})
        state.update({n: c.clone().to(next(iter(params.values())).device) for n, c in self.constants.items()})
        return state


@dataclass(frozen=True)
class DropoutSite:
    """One call of a dropout module in the forward pass: its drop probability and the mask's per-sample shape."""

    module: nn.Module
    p: float
    shape: tuple[int, ...]


def dropout_sites(net: nn.Module, samples: torch.Tensor, name: str) -> list[DropoutSite]:
    """The dropout calls of one train-mode forward pass, in call order, found by a probe on `samples` (two, of
    the kind the model takes: zeros, or token ids)."""
    for module_name, m in net.named_modules():
        if isinstance(m, (nn.AlphaDropout, nn.FeatureAlphaDropout)):
            raise ConfigError("model", name, f"module '{module_name}' is an {type(m).__name__}; the engine draws "
                              "dropout masks itself for nn.Dropout and nn.Dropout1d/2d/3d only")
    modules = [m for m in net.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    if not modules:
        return []
    found: list[DropoutSite] = []

    def record(m, args):
        x = args[0]
        shape = tuple(x.shape[1:2]) + (1,) * (x.dim() - 2) if isinstance(m, CHANNEL_DROPOUT) else tuple(x.shape[1:])
        found.append(DropoutSite(m, float(m.p), shape))

    hooks = [m.register_forward_pre_hook(record) for m in modules]
    training = net.training
    try:
        net.eval()  # no BatchNorm statistics move; the hooks see the shapes all the same
        with torch.no_grad():
            net(samples)
    finally:
        net.train(training)
        for h in hooks:
            h.remove()
    return found


def draw_masks(sites: Sequence[DropoutSite], seeds: np.ndarray, batch: int, dtype: torch.dtype,
               device: torch.device) -> list[torch.Tensor]:
    """Scaled keep masks [M, batch, *site.shape] of every site for M copies: copy m's come from a generator seeded
    by seeds[m] (one per copy and step), so they depend on that copy's stream key only."""
    per_copy: list[list[torch.Tensor]] = [[] for _ in sites]
    for seed in seeds:
        gen = torch.Generator().manual_seed(int(seed))
        for i, site in enumerate(sites):
            u = torch.rand((batch, *site.shape), generator=gen)
            per_copy[i].append((u >= site.p).to(dtype) / (1.0 - site.p))
    return [torch.stack(masks).to(device) for masks in per_copy]


@contextlib.contextmanager
def masked_dropout(sites: Sequence[DropoutSite], masks: Sequence[torch.Tensor] | None) -> Iterator[None]:
    """While inside, the sites' modules multiply by the given masks in call order (none: they keep all units)."""
    if not sites:
        yield
        return
    calls = iter(range(len(sites)))

    def forward(x: torch.Tensor) -> torch.Tensor:
        i = next(calls, None)
        if i is None:
            raise RuntimeError("a dropout module ran more often than in the probe forward pass; the forward pass "
                               "must call the same dropout modules on every batch")
        return x * masks[i] if masks else x

    modules = {id(s.module): s.module for s in sites}
    for m in modules.values():
        m.forward = forward  # an instance attribute shadows the class's forward until deleted
    try:
        yield
    finally:
        for m in modules.values():
            del m.forward
