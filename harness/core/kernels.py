"""How a network's clients' minibatch gradients are computed in one batched step (`kernel`), and `auto`'s choice.

  vmap                 torch.func.vmap over the client copies: one batched computation per step (a convolution
                       over the copies' own weights becomes one grouped convolution)
  loop                 one client copy after another inside the shard's step (the solver still updates all
                       copies at once): wins where a grouped convolution is slower than K plain ones
  loop_channels_last   the loop with images and convolution weights in channels-last memory format (tensor cores
                       prefer it for convolutions on CUDA)
  fused                one client copy after another by plain autograd (no torch.func), the net's recurrent layers
                       on torch's fused LSTM kernel (and its fused backward): offered where the net has such layers
                       (char_lstm, word_lstm, sent_lstm), the fastest on a CPU (docs/performance.md)
  auto                 the fastest of those on this machine, for the run's model, batch size, dtype, precision
                       and copies per round: timed once (a few gradients each) and remembered in
                       $FEDHARNESS_CACHE/kernels.json, so later runs make the same choice and repeat bit for bit
                       (the formulations agree only up to rounding). Delete the entry to time it again.
                       Processes that miss the cache together measure one at a time (a lock beside the cache):
                       the first measures and writes, the others then read its choice, so runs started
                       together choose alike. The shard count is not in the key: a run's bits do not
                       depend on how its clients are split over shards (tests/test_same_bits.py), so 1 and
                       3 shards must use the same formulation. Nor is the thread count: `threads: null`
                       follows the machine's load at each run's start, and the kernels' times differ by 1-5%
                       between 1 and 2 threads (issue 47), so a run at another count reuses the choice rather
                       than timing again under whatever load made its count differ.
                       A candidate whose estimated step memory exceeds memory_budget_gb is not timed (vmap holds
                       every copy's activations at once, a loop one copy's); where one is left it is taken untimed.
                       A net with a fused formulation whose training set is too small to be worth timing
                       (`too_small`) takes fused on a CPU, untimed. Untimed choices are not remembered.
Linear models have one formulation (their closed-form gradient) and ignore the key.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from fedharness.base.files import atomic_text, cache_dir
from fedharness.errors import require
from fedharness.settings import RunSettings

log = logging.getLogger(__name__)

KERNELS = ("vmap", "loop", "loop_channels_last", "fused")
MEASURE_COPIES = 64  # at most this many copies are timed: enough to fill a GPU, bounded start-up cost
REPEATS = 3  # timed calls per formulation after one warm-up call; the median counts

CACHE_FORMAT = 2  # 2: copies per round, not per shard step. Bump when the meaning of a remembered choice changes


def candidates(objective, probe: bool = True) -> tuple[str, ...]:
    """The formulations worth timing: channels-last only for a network with 4-D (convolution) weights, fused only
    for one with fused-kernel layers, vmap only where vmap runs the module (`probe`=False: assumed, unprobed)."""
    conv = any(len(shape) == 4 for shape in objective.shapes)
    found = KERNELS[:3] if conv else KERNELS[:2]
    found = found if not probe or objective.vmappable else found[1:]  # a module vmap cannot run: loops only
    return (*found, "fused") if objective.fusable else found


def step_bytes(objective, kernel: str, copies: int, batch: int, itemsize: int) -> int:
    """Estimated activation bytes of one batched gradient of `copies` copies: vmap holds every copy's at once, the
    loops one copy's at a time (the parameter vectors, the same for all, are the executor's to bound)."""
    return (copies if kernel == "vmap" else 1) * objective.activation_bytes(batch, itemsize)


def within_budget(problem, copies: int) -> tuple[str, ...]:
    """The candidates whose estimated step fits the problem's memory budget (all of them where it has none)."""
    found, budget = candidates(problem.objective), problem.memory_budget
    if budget is None:
        return found
    item = torch.empty((), dtype=problem.dtype).element_size()
    return tuple(k for k in found if step_bytes(problem.objective, k, copies, problem.batch_size, item) <= budget)


def _samples(problem) -> int:
    """The training samples of the problem's clients (n_k summed)."""
    return int(problem.sizes.sum())


def too_small(problem, copies: int) -> bool:
    """Whether kernel=auto takes fused untimed: on a CPU, for a net that offers it (about 3x the functional path's
    speed there, docs/performance.md), where the training set holds fewer samples than timing would compute
    gradients of, (1 + REPEATS) x candidates x copies x batch. There timing costs more than a pass over all the
    data (issue 47's six-user folder: 265 windows, against 864 timed at 3 copies of 24 over vmap, loop and fused,
    with seconds of torch.func's first use and vmap's probe besides) and saves less than it costs. Nets without a
    fused formulation have no choice known in advance (vmap against loop depends on the net and the machine):
    they are timed."""
    offered, samples = candidates(problem.objective, probe=False), _samples(problem)
    return "fused" in offered and problem.device.type == "cpu" \
        and samples < (1 + REPEATS) * len(offered) * copies * problem.batch_size


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously: a timing ends when its kernels do)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(objective, copies: int, batch: int, device: torch.device, dtype: torch.dtype,
            names: tuple[str, ...] | None = None) -> dict[str, float]:
    """Median seconds of one batched gradient of `copies` client copies, per formulation (`names`, default every
    candidate; random inputs of the model's shape: the time of a network's step does not depend on the pixel
    values, nor on the token ids)."""
    gen = torch.Generator().manual_seed(0)
    w = objective.init(1, 0, dtype).to(device).expand(copies, -1).contiguous()
    x = objective.inputs(copies, batch, dtype=dtype, generator=gen).to(device)  # token ids: zeros
    y = torch.zeros(copies, batch, dtype=torch.int64, device=device)
    chosen, timings = objective.kernel, {}
    try:
        for name in names or candidates(objective):
            objective.kernel = name
            objective.batch_grad(w, (x, y))  # warm-up: cuDNN's plans, allocator
            seconds = []
            for _ in range(REPEATS):
                synchronize(device)
                start = time.perf_counter()
                objective.batch_grad(w, (x, y))
                synchronize(device)
                seconds.append(time.perf_counter() - start)
            timings[name] = float(np.median(seconds))
    finally:
        objective.kernel = chosen
    return timings


def copies_per_round(settings: RunSettings, num_clients: int) -> int:
    """Client copies trained in a round: sampled clients x replicas. Not divided by the shards: were the shard
    count in the key, 1 and 3 shards could time differently, choose different formulations and differ in the
    last bits."""
    algorithm = settings.algorithm
    per_round = num_clients if algorithm.sampler == "full" else algorithm.clients_per_round
    return max(1, int(per_round) * int(settings.replicas))


def resolve_kernel(settings: RunSettings, problem, resumed_kernel: str | None = None) -> str:
    """The formulation this run uses, set on the problem's network; the runner records it in the run's settings
    (so the runs/ row and every Ray shard see it). A resumed run keeps the one its checkpoint recorded."""
    objective = problem.objective
    wanted = settings.kernel
    # a quadratic or a linear model: nothing to choose (asked of the class: a net's kernel, read, may probe vmap)
    if objective is None or type(objective).kernel is None:
        return wanted
    require(wanted != "fused" or objective.fusable, "kernel", wanted,
            f"auto | vmap | loop | loop_channels_last for model {objective.name} (fused: a net with fused LSTM layers, "
            "char_lstm, word_lstm, sent_lstm)")
    if wanted == "auto":
        wanted = resumed_kernel if resumed_kernel in KERNELS else _auto(settings, problem)
    objective.kernel = wanted
    return objective.kernel  # `vmap` for a module vmap cannot run is `loop` (problems/objectives.py)


def _auto(settings: RunSettings, problem) -> str:
    objective, device = problem.objective, problem.device
    copies = min(MEASURE_COPIES, copies_per_round(settings, problem.num_clients))
    if too_small(problem, copies):
        if settings.progress:
            log.info(f"kernel=auto took fused untimed: {_samples(problem)} training samples, fewer than timing "
                     "would compute gradients of")
        return "fused"
    loop = "fused" if "fused" in candidates(objective) else "loop"
    names = within_budget(problem, copies) or (loop,)  # none fits: a loop, one copy at a time
    if len(names) == 1:
        return names[0]
    key = json.dumps([CACHE_FORMAT, objective.name, objective.in_shape, objective.dim, copies, problem.batch_size,
                      _device_name(device), str(problem.dtype), settings.precision, torch.__version__])
    remembered = _remembered(key, names)
    if remembered is not None:
        return remembered
    with _measuring():
        remembered = _remembered(key, names)  # a process that held the lock before us may have measured it
        if remembered is not None:
            return remembered
        timings = measure(objective, copies, problem.batch_size, device, problem.dtype, names)
        chosen = min(timings, key=timings.get)
        _remember(key, {"kernel": chosen, "ms": {k: 1e3 * v for k, v in timings.items()}})
    if settings.progress:
        log.info(f"kernel=auto chose {describe(chosen, timings, copies)}; remembered in {cache_path()}")
    return chosen


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return " ".join(filter(None, ("cpu", platform.machine(), platform.processor(), f"x{os.cpu_count()}")))


def cache_path() -> Path:
    return cache_dir() / "kernels.json"


def _remembered(key: str, names: tuple[str, ...]) -> str | None:
    """The cache's choice for `key` where it is one of `names` (a choice over this run's memory budget is not)."""
    found = _read_cache().get(key, {}).get("kernel")
    return found if found in names else None


@contextmanager
def _measuring() -> Iterator[None]:
    """Held while a process measures and writes a choice: an exclusive flock on kernels.json.lock, so processes that
    missed the cache together measure one after another and the later ones find the first one's choice. A cache
    folder that cannot be written holds no lock (each process measures, as its choice cannot be kept anyway)."""
    path = cache_path().with_name("kernels.json.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes, or when the process dies
        yield


def _read_cache() -> dict:
    try:
        found = json.loads(cache_path().read_text())
        return found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        return {}


def _remember(key: str, entry: dict) -> None:
    """Add one choice (the file is replaced whole). A cache that cannot be written only costs the next run a
    measurement."""
    try:
        atomic_text(cache_path(), json.dumps({**_read_cache(), key: entry}, indent=1))
    except OSError:
        pass


def describe(chosen: str, timings: dict[str, float], copies: int) -> str:
    """'loop (ms per batched gradient of 16 copies: vmap 12.1, loop 8.3)'."""
    listed = ", ".join(f"{name} {seconds * 1e3:.3g}" for name, seconds in timings.items())
    return f"{chosen} (ms per batched gradient of {copies} copies: {listed})"
