"""Ray shards sharing one GPU, and the same trajectory on a GPU (issue 11, points 4 and 5).

Workload: CNN on MNIST-shaped data (IDX files in a temporary data_dir that every shard reads), N = K = 100
clients (full participation), 5 local steps of b = 32 (smoke: N = 4, 2 steps of b = 8).

(a) sharing: ms per round (local training only) of inline (one process, the whole device) against
    executor=ray with S shards of 1/S GPU each (ray.gpus_per_shard; 0 on CPU), S = 1, 2, 4 (smoke: 1, 2).
    Inline and each S take turns round by round in one process, so other load hits both alike.
(b) determinism: train_loss after each of 20 rounds (smoke: 3) of whole runs (fedharness's `execute`):
    inline twice with the default flags, inline against ray with 4 shards of 0.25 GPU, both with the default
    flags and with deterministic=true: the largest relative difference of each pair, and ms per round of
    deterministic=true against the default (its cost; from the second inline run of each, past one-time costs).

    python benchmarks/gpu_shards.py --device cuda [--rounds 5] [--sections sharing,determinism]
                                    [--precision fp32|tf32|bf16] [--threads N]
    python benchmarks/gpu_shards.py --device cpu --smoke
Writes benchmarks/out/gpu_shards.json. A benchmark, not a test: nothing asserts a time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_ray import paired_rounds, write_mnist_shaped
from fedharness.config.load import load_settings
from fedharness.core.executors import InlineExecutor
from fedharness.assembly.build import build_parts
from fedharness.runs.execute import execute, set_threads
from fedharness.settings import RunSettings

OUT = Path(__file__).parent / "out"


def workload(args, data_dir: Path, *extra: str) -> RunSettings:
    """The CNN run's settings of this benchmark, results in a fresh temporary folder."""
    clients, steps, batch = (4, 2, 8) if args.smoke else (100, 5, 32)
    return load_settings([
        "model=cnn", "dataset=mnist", f"dataset.data_dir={data_dir}", f"dataset.num_clients={clients}",
        "algorithm.sampler=full", f"algorithm.local_steps={steps}", f"algorithm.batch_size={batch}",
        "algorithm.client_lr=0.05", "heterogeneity=false", f"device={args.device}", "progress=false",
        f"precision={args.precision}", f"threads={args.threads or 'null'}", f"results_dir={tempfile.mkdtemp()}",
        *extra])


def ray_overrides(args, shards: int) -> list[str]:
    gpus = 1 / shards if args.device.startswith("cuda") else 0
    return ["executor=ray", f"ray.num_shards={shards}", f"ray.gpus_per_shard={gpus:.6g}", "ray.cpus_per_shard=1"]


def sharing(args, data_dir: Path) -> list[dict]:
    """Inline against S shards on one device, paired round by round; one Ray executor at a time (each takes
    the whole GPU between its shards)."""
    import ray

    from fedharness.core import ray_cluster
    from fedharness.backends.ray_executor import RayExecutor

    cfg = workload(args, data_dir, "rounds=1000")
    set_threads(cfg)
    threads = torch.get_num_threads()
    problem, algorithm = build_parts(cfg)
    inline = InlineExecutor(problem, algorithm.solver, 1)
    ray_cluster.start_local(num_cpus=4)
    records = []
    try:
        for shards in (1, 2) if args.smoke else (1, 2, 4):
            rcfg = workload(args, data_dir, "rounds=1000", *ray_overrides(args, shards))
            executor = RayExecutor(rcfg, problem, algorithm.solver)
            times = paired_rounds({"inline": (cfg, problem, algorithm, inline, threads),
                                   "ray": (rcfg, problem, algorithm, executor, threads)}, args.rounds, warmup=1)
            executor.close()
            inline_ms, ray_ms = (1e3 * float(np.median(times[k])) for k in ("inline", "ray"))
            records.append({"shards": shards, "gpu_per_shard": 1 / shards if args.device.startswith("cuda") else 0,
                            "inline_ms": inline_ms, "ray_ms": ray_ms, "ray_vs_inline": ray_ms / inline_ms})
            print(f"  {shards} shard(s): inline {inline_ms:9.1f} ms/round   ray {ray_ms:9.1f}   "
                  f"ray/inline {ray_ms / inline_ms:5.2f}x", flush=True)
    finally:
        ray.shutdown()
    return records


def _losses_and_time(cfg: RunSettings) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    result = execute(cfg)
    seconds = time.perf_counter() - start
    return np.array([r["train_loss"] for r in result.rows if r["round"] > 0]), seconds / cfg.rounds


def _max_relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.abs(b)))


def determinism(args, data_dir: Path) -> dict:
    """How far runs that should agree drift apart, with and without deterministic=true, and what it costs."""
    rounds = 3 if args.smoke else 20
    out = {}
    for det in ("false", "true"):
        common = (f"rounds={rounds}", "eval_every=1", f"deterministic={det}")
        # the second inline run's time: the first pays one-time costs (data loading, kernel=auto's timing)
        (inline, _), (again, s), (ray_run, _) = (_losses_and_time(workload(args, data_dir, *common, *extra))
                                                  for extra in ((), (), ray_overrides(args, 4)))
        found = {"inline_twice": _max_relative(again, inline), "inline_vs_ray": _max_relative(ray_run, inline),
                 "s_per_round": s}
        out[f"deterministic={det}"] = found
        print(f"  deterministic={det:<5}  inline twice {found['inline_twice']:.2e}   "
              f"inline vs ray (4 shards) {found['inline_vs_ray']:.2e}   "
              f"inline {1e3 * s:.1f} ms/round (with evaluation)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each variant in (a)")
    parser.add_argument("--sections", default="sharing,determinism")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads of inline runs and of each shard")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that everything runs")
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp())
    write_mnist_shaped(data_dir, 400 if args.smoke else 16_000, 100 if args.smoke else 1_000)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"{'smoke, ' if args.smoke else ''}{args.device} ({name}), torch {torch.__version__}, "
          f"precision {args.precision}, threads {args.threads or 'default'}")
    report = {"device": args.device, "name": name, "smoke": args.smoke}
    sections = args.sections.split(",")
    if "sharing" in sections:
        print("(a) Ray shards sharing the device, against inline (local training, median ms/round):")
        report["sharing"] = sharing(args, data_dir)
    if "determinism" in sections:
        print("(b) largest relative difference of train_loss over the rounds:")
        report["determinism"] = determinism(args, data_dir)
    OUT.mkdir(exist_ok=True)
    (OUT / "gpu_shards.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
