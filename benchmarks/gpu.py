"""Engine benchmark at paper scale (issue 11): the vectorized engine vs the per-client loop on networks.

Workloads (full participation, random data of the real shapes: timing does not depend on pixel values):
  cnn_mnist_K100      CNN on 1x28x28, K = 100 clients, 5 local steps, b = 32
  vgg11_cifar_K10     VGG-11 on 3x32x32, K = 10, 5 steps, b = 32
  resnet18_cifar_K10  ResNet-18 on 3x32x32, K = 10, 5 steps, b = 32
  resnet18_cifar_K50  ResNet-18, K = 50
  wang_cifar10        `experiment=wang_cifar10 scale=paper algorithm=fednova` on a random CIFAR-10-shaped
                      data set written in the real file format (Dirichlet(0.1) sizes, so tau_k differ)
For each: the kernel formulations of the batched client gradient (harness/core/kernels.py: vmap, loop,
loop_channels_last), ms per batched gradient of min(K, 64) copies, and the fastest; then ms/round
(steady state, the first round left out) of executor=inline with that kernel (or --kernel) and of
executor=loop (one client at a time), achieved TFLOP/s (FLOPs of one client step counted once with
FlopCounterMode), and the useful fraction of the computed steps, sum tau / (K max tau), before the
shrinking batch (every client ran max tau steps under a mask) and after it (sum tau rows: 1), and on CUDA
the peak memory of the vectorized rounds (chunked to memory_budget_gb: --replicas 3 on wang_cifar10 is the
case that ran out of memory before chunking).

    python benchmarks/gpu.py --device cuda [--rounds 3] [--workloads a,b] [--precision fp32|tf32|bf16]
                             [--kernel fastest|vmap|loop|loop_channels_last] [--replicas R]
    python benchmarks/gpu.py --device cpu --smoke        # tiny sizes, a check that it all runs
`make bench-gpu ARGS="--device cuda" NETS_ARGS="--replicas 3"` runs this and benchmarks/gpu_shards.py (ARGS
go to both, NETS_ARGS here only). Writes benchmarks/out/gpu.json. A benchmark, not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from fedharness.config.load import load_settings
from fedharness.errors import ConfigError
from fedharness.core.executors import InlineExecutor, LoopExecutor
from fedharness.problems.data import DataProblem
from fedharness.problems.nets import build_net
from fedharness.problems.objectives import NetObjective
from fedharness.assembly.build import algorithm_for
from fedharness.algorithms.series import build_series
from fedharness.runs.execute import Prepared, build_engine, prepare
from fedharness.core import kernels
from fedharness.base.runtime import apply_runtime, memory_budget_bytes
from fedharness.settings import RunSettings

NETS = {  # name: (model, image shape, clients K)
    "cnn_mnist_K100": ("cnn", (1, 28, 28), 100),
    "vgg11_cifar_K10": ("vgg11", (3, 32, 32), 10),
    "resnet18_cifar_K10": ("resnet18", (3, 32, 32), 10),
    "resnet18_cifar_K50": ("resnet18", (3, 32, 32), 50),
}
STEPS, BATCH = 5, 32
SMOKE_STEPS, SMOKE_BATCH, SMOKE_CLIENTS = 2, 2, 3
WORKLOADS = (*NETS, "wang_cifar10")


def _base_config(args, *overrides: str) -> RunSettings:
    return load_settings([f"results_dir={tempfile.mkdtemp()}", "progress=false", f"device={args.device}",
                        f"precision={args.precision}", *overrides])


def net_workload(name: str, args):
    """A DataProblem of random images for the network workload `name`, and its algorithm (FedAvg, full)."""
    model, shape, clients = NETS[name]
    steps, batch = (SMOKE_STEPS, SMOKE_BATCH) if args.smoke else (STEPS, BATCH)
    clients = min(clients, SMOKE_CLIENTS) if args.smoke else clients
    cfg = _base_config(args, "algorithm.sampler=full", f"algorithm.local_steps={steps}",
                       f"algorithm.batch_size={batch}", f"dataset.num_clients={clients}")
    rng = np.random.default_rng(0)
    n = steps * batch  # samples per client
    x = rng.standard_normal((clients * n, *shape), dtype=np.float32)
    y = rng.integers(0, 10, clients * n)
    objective = NetObjective(build_net(model, shape, 10), model, 0.0, shape,
                             torch.bfloat16 if args.precision == "bf16" else None)
    index = list(np.arange(clients * n).reshape(clients, n))
    problem = DataProblem(objective, x, y, index, None, None, batch, torch.float32, args.device,
                          memory_budget_bytes(cfg.memory_budget_gb, torch.device(args.device)))
    return cfg, problem, algorithm_for(cfg, problem)


def fake_cifar(folder: Path, per_batch: int) -> None:
    """Random CIFAR-10 batches in the official pickle format (data [n, 3072] uint8, labels 0..9)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, per_batch).tolist()}
        (folder / name).write_bytes(pickle.dumps(entry))


def wang_workload(args):
    """Wang et al.'s CIFAR-10 setting through its config, as a user runs it (smoke: tiny data and batch)."""
    data = Path(tempfile.mkdtemp())
    fake_cifar(data / "cifar-10-batches-py", 16 if args.smoke else 10_000)
    extra = ["algorithm.batch_size=8"] if args.smoke else []
    cfg = _base_config(args, "experiment=wang_cifar10", f"scale={'smoke' if args.smoke else 'paper'}",
                       "algorithm=fednova", f"dataset.data_dir={data}", *extra)
    problem, algorithm, _ = prepare(cfg)
    return cfg, problem, algorithm


def flops_per_client_step(problem, batch: int) -> float:
    """FLOPs of one client's minibatch gradient (forward and backward), counted once by torch."""
    net = problem.objective.net.to(problem.device)
    x = torch.zeros(batch, *problem.x.shape[1:], device=problem.device)
    y = torch.zeros(batch, dtype=torch.int64, device=problem.device)
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    net.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def time_rounds(cfg: RunSettings, problem, algorithm, executor_cls, rounds: int, device: str,
                replicas: int) -> tuple[float, np.ndarray]:
    """Seconds per round after one untimed round, and the timed rounds' tau [rounds, K] (replica 0's)."""
    run = Prepared(cfg.replace(seed=0, replicas=replicas), problem, algorithm, None, *build_series(replicas))
    engine = build_engine(run, executor_cls(problem, algorithm.solver))
    state = engine.step(engine.initial_state())
    tau = np.stack([engine.plan_round(r)[0].tau[0] for r in range(1, rounds + 1)])
    kernels.synchronize(device)
    start = time.perf_counter()
    for _ in range(rounds):
        state = engine.step(state)
    kernels.synchronize(device)
    return (time.perf_counter() - start) / rounds, tau


def choose_kernel(problem, args, clients: int) -> tuple[str, dict[str, float]]:
    """Every formulation's ms per batched gradient, and the kernel the rounds use (--kernel, or the fastest)."""
    copies = min(kernels.MEASURE_COPIES, clients)
    timings = kernels.measure(problem.objective, copies, problem.batch_size, problem.device, problem.dtype)
    chosen = min(timings, key=timings.get) if args.kernel == "fastest" else args.kernel
    problem.objective.kernel = chosen
    return chosen, {name: 1e3 * s for name, s in timings.items()}


def measure(name: str, args) -> dict:
    cfg, problem, algorithm = wang_workload(args) if name == "wang_cifar10" else net_workload(name, args)
    flops_step = flops_per_client_step(problem, algorithm.batch_size)
    kernel, kernel_ms = choose_kernel(problem, args, problem.num_clients)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    fast, tau = time_rounds(cfg, problem, algorithm, InlineExecutor, args.rounds, args.device, args.replicas)
    peak_gb = torch.cuda.max_memory_allocated() / 1e9 if args.device.startswith("cuda") else None
    slow = loop_seconds(cfg, problem, algorithm, args)
    steps = args.replicas * tau.sum(1).mean()  # client steps per round (full participation, every replica)
    return {"workload": name, "kernel": kernel, "kernel_ms": kernel_ms, "clients": int(tau.shape[1]),
            "replicas": args.replicas, "peak_gb": peak_gb, "budget_gb": problem.memory_budget / 1e9,
            "tau_min": int(tau.min()), "tau_max": int(tau.max()),
            "sum_tau": float(steps), "K_max_tau": float((tau.shape[1] * tau.max(1)).mean()),
            "useful_before": float(tau.sum() / (tau.shape[1] * tau.max(1)).sum()), "useful_after": 1.0,
            "ms_vectorized": fast * 1e3, "ms_loop": None if slow is None else slow * 1e3,
            "speedup": None if slow is None else slow / fast, "gflop_per_round": steps * flops_step / 1e9,
            "tflops_vectorized": steps * flops_step / fast / 1e12,
            "tflops_loop": None if slow is None else steps * flops_step / slow / 1e12}


def loop_seconds(cfg, problem, algorithm, args) -> float | None:
    """Seconds per round of the per-client loop; None where --loop-rounds is 0 or the loop executor refuses the
    model (a net with buffers or dropout: its eval-mode loss would not train what the engine trains)."""
    if args.loop_rounds == 0:
        return None
    try:
        return time_rounds(cfg, problem, algorithm, LoopExecutor, args.loop_rounds, args.device, args.replicas)[0]
    except ConfigError as refused:
        print(f"loop not timed: {refused}", flush=True)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop-rounds", type=int, default=1, help="timed rounds of the per-client loop (0: "
                        "none)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    parser.add_argument("--kernel", default="fastest", choices=("fastest", *kernels.KERNELS),
                        help="the kernel of the vectorized rounds (fastest: the fastest measured)")
    parser.add_argument("--replicas", type=int, default=1, help="seeds batched with the clients (memory: chunked "
                        "to memory_budget_gb, e.g. --replicas 3 on wang_cifar10)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that everything runs")
    args = parser.parse_args()
    apply_runtime(args.precision)  # as the runner's set_threads does for a net: threads only where given
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"{'smoke, ' if args.smoke else ''}{args.device} ({device}), torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, precision {args.precision}, replicas {args.replicas}")
    print(f"{'workload':<20}{'K':>4}{'tau':>10}{'useful before/after':>21}{'vectorized ms':>15}{'loop ms':>11}"
          f"{'speedup':>9}{'TFLOP/s vec':>13}{'loop':>8}{'peak GB':>9}   kernel (ms per batched gradient)")
    records = []
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    for name in args.workloads.split(","):
        r = measure(name, args)
        records.append(r)
        # written after each workload, so that a run stopped part way keeps what it measured
        (out / "gpu.json").write_text(json.dumps({"device": args.device, "name": device, "smoke": args.smoke,
                                                  "precision": args.precision, "kernel": args.kernel,
                                                  "results": records}, indent=2))
        listed = ", ".join(f"{k} {ms:.3g}" for k, ms in r["kernel_ms"].items())
        loop = ("-", "-", "-") if r["ms_loop"] is None else (
            f"{r['ms_loop']:.1f}", f"{r['speedup']:.1f}x", f"{r['tflops_loop']:.4f}")
        print(f"{name:<20}{r['clients']:>4}{r['tau_min']:>5}..{r['tau_max']:<3}{r['useful_before']:>14.2f} / 1.00"
              f"{r['ms_vectorized']:>15.1f}{loop[0]:>11}{loop[1]:>9}"
              f"{r['tflops_vectorized']:>13.4f}{loop[2]:>8}"
              f"{'-' if r['peak_gb'] is None else format(r['peak_gb'], '.2f'):>9}   {r['kernel']} ({listed})", flush=True)


if __name__ == "__main__":
    main()
