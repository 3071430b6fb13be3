"""How a run uses its device: numeric precision, determinism, and the memory budget of batched work.

Keys (top level of the run config):
  precision         fp32 | tf32 | bf16   fp32: true float32 matmuls and convolutions (cuDNN's TF32 default
                                         off); tf32: TF32 matmuls/convolutions on CUDA (no-op on CPU); bf16:
                                         network forward/backward under autocast(bfloat16), weights, client
                                         updates and aggregation stay float32/float64
  deterministic     bool                 deterministic CUDA kernels (cuBLAS workspace, cuDNN), same bits run to run
  memory_budget_gb  null | number > 0    bytes (10^9 per GB) one batched training or evaluation step may use;
                                         null: BUDGET_FRACTION of the device's free memory when the run starts
"""

from __future__ import annotations

import os

import torch


BUDGET_FRACTION = 0.5  # of the free device memory, for memory_budget_gb=null


def apply_runtime(precision: str = "fp32", deterministic: bool = False) -> None:
    """Set the process-wide torch flags of `precision` and `deterministic` (both ways: a process may run
    several configs). Call before the first CUDA matmul: cuBLAS reads its workspace setting once."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
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
