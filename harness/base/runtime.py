"""How a run uses its device: numeric precision, determinism, and the memory budget of batched work.

Keys (top level of the run config):
  precision         fp32 | tf32 | bf16   fp32: true float32 matmuls and convolutions (cuDNN's TF32 default
                                         off); tf32: TF32 matmuls/convolutions on CUDA (no-op on CPU); bf16:
                                         network forward/backward under autocast(bfloat16), weights, client
                                         updates and aggregation stay float32/float64
  deterministic     bool                 deterministic CUDA kernels (cuBLAS workspace, cuDNN), same bits run to run
  memory_budget_gb  null | number > 0    bytes (10^9 per GB) one batched training or evaluation step may use;
                                         null: BUDGET_FRACTION of the device's free memory when the run starts
  threads           null | int >= 1      torch's intra-op threads; null: auto_threads of the work of one local
                                         step, whatever the model is called (a built-in or a user's net), and of
                                         the cores other processes leave free (free_cores), at the run's start;
                                         the run records the count, and a resumed run reuses it
"""

from __future__ import annotations

import math
import os
import time

import torch


BUDGET_FRACTION = 0.5  # of the free device memory, for memory_budget_gb=null
# Multiply-adds of one batched local step per torch thread: below it a thread's share is too small to pay for
# handing work over (W1's 1 replica, 146k, runs no faster on 2 idle cores; its 64 replicas, 9.4M, run 1.5x
# faster), and on a busy machine threads waiting for cores other processes hold cost 10-100x.
WORK_PER_THREAD = 2**20
# free_cores: the busy time of the cores is read over LOAD_WINDOW_S (100 Hz ticks: 0.2 s reads a core's share to
# about 0.05), and a core counts as free when at least CORE_FREE of it was idle: a second thread that must share
# its core waits for it at every parallel region (measured: benchmarks/bench_threads.py, docs/performance.md).
LOAD_WINDOW_S = 0.2
CORE_FREE = 0.75
_SET: tuple[int, int] | None = None  # (threads use_threads set, the setting it replaced)


def apply_runtime(precision: str = "fp32", deterministic: bool = False) -> None:
    """Set the process-wide torch flags of `precision` and `deterministic` (both ways: a process may run
    several configs). Call before the first CUDA matmul: cuBLAS reads its workspace setting once."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if torch.are_deterministic_algorithms_enabled() != deterministic:  # setting it imports torch's compiler (1.3 s)
        torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = False


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype networks' forward/backward run in under autocast (None: the parameters' own)."""
    return torch.bfloat16 if precision == "bf16" else None


def memory_budget_bytes(budget: float | None, device: torch.device) -> int:
    """memory_budget_gb (`budget`) in bytes, or BUDGET_FRACTION of what the device has free now."""
    if budget is not None:
        return int(budget * 1e9)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_ram()
    return int(BUDGET_FRACTION * free)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo, else the free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def step_work(dim: int, clients: int, batch: int, replicas: int) -> int:
    """Multiply-adds of one batched local step, roughly: each parameter once per sample of each client's
    minibatch, for every client copy of every replica (the vectorized path trains them at once)."""
    return dim * clients * batch * replicas


def available_threads() -> int:
    """The threads the process allows: torch's setting (its default, or the caller's), or the one use_threads
    replaced when the current setting is still use_threads' own (a tiny run must not bind a later big one)."""
    now = torch.get_num_threads()
    return _SET[1] if _SET is not None and _SET[0] == now else now


def auto_threads(work: int, available: int | None = None, load: bool = True) -> int:
    """`threads: null`: one thread per WORK_PER_THREAD multiply-adds of a step, at least 1, at most `available`
    (default available_threads()) and, with `load`, at most free_cores() (measured only where the work wants
    more than one thread)."""
    cap = available_threads() if available is None else available
    wanted = max(1, min(cap, work // WORK_PER_THREAD))
    return min(wanted, free_cores()) if load and wanted > 1 else wanted


def free_cores(window: float = LOAD_WINDOW_S) -> int:
    """The cores of this process's CPU set that other processes leave free, at least 1: the cores less the time
    they were busy over the next `window` seconds (/proc/stat), less this process's own CPU time in it; a core
    counts when at least CORE_FREE of it is idle. Not the load average: it trails the load by a minute and
    counts this process's own earlier work. Without /proc/stat (not Linux): the cores less the 1-minute load."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        busy, own, start = _busy_seconds(cpus), time.process_time(), time.monotonic()
        time.sleep(window)
        others = (_busy_seconds(cpus) - busy - (time.process_time() - own)) / (time.monotonic() - start)
    except (OSError, ValueError):
        others = os.getloadavg()[0]
    return max(1, math.floor(len(cpus) - others + 1 - CORE_FREE))


def _busy_seconds(cpus: set[int]) -> float:
    """Seconds the cpus `cpus` spent busy since boot: every /proc/stat field of theirs but idle and iowait."""
    ticks = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal (guest: in user)
                ticks += sum(values) - values[3] - values[4]
    return ticks / os.sysconf("SC_CLK_TCK")


def use_threads(threads: int) -> None:
    """torch.set_num_threads, remembering the setting it replaced (see available_threads)."""
    global _SET
    before = available_threads()
    torch.set_num_threads(threads)
    _SET = (threads, before)
