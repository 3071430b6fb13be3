"""Ray executor benchmarks: (a) overhead against inline where compute dominates, (b) lazily generated clients.

(a) CNN (582k parameters) on MNIST-shaped data (28x28 images with class templates, written as
    IDX files to a temporary data_dir that every shard reads), N=10 clients x 600 images, K=4 per
    round, 20 local steps of b=32: seconds per round of inline with 1 torch thread, inline with one
    thread per core, the Ray executor with 1 shard (1 CPU, 1 thread) and with 2 shards. Ray's
    overhead is ray-1-shard / inline-1-thread (the same compute, plus Ray; goal <= 1.3x).
(b) dataset=synthetic_lazy (Synthetic(1,1), 200 samples per client, logistic regression), K=100 per
    round (scheme I), 20 local steps of b=24, Ray executor with 2 shards, N = 1,000 and N = 100,000
    clients, plus N = 1,000 with the client cache off (it then generates its sampled clients every
    round, as N = 100,000 does): seconds per round, and peak resident memory of the driver and of
    each shard, also net of the process's size after its imports (goals: memory set by the sampled
    clients, not N; N = 100,000 within 1.5x of N = 1,000). Memory is also measured at N = 1,000 and
    N = 100,000 with the same 16 MB client cache, to show that the cache, not N, sets it.

Timings are paired: all variants of a part live in one process and take turns round by round
on the same model and plan, so load from other work on the machine hits them alike. Memory is
measured in a separate process per case, each with its own local Ray on 127.0.0.1. Prints a
table and writes benchmarks/out/ray.json.

    python benchmarks/bench_ray.py [--rounds 6] [--skip-cnn] [--skip-lazy]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from statistics import median

from children import run_child
from outputs import publish
CNN = ["model=cnn", "dataset=mnist", "dataset.num_clients=10", "algorithm.clients_per_round=4",
       "algorithm.sampler=scheme_ii", "algorithm.local_steps=20", "algorithm.batch_size=32",
       "algorithm.client_lr=0.05", "heterogeneity=false"]
LAZY = ["dataset=synthetic_lazy", "dataset.samples_per_client=200", "algorithm.clients_per_round=100",
        "algorithm.local_steps=20", "algorithm.batch_size=24", "algorithm.client_lr=0.05", "heterogeneity=false",
        "ray.num_shards=2"]


def write_mnist_shaped(folder: Path, n_train: int, n_test: int, seed: int = 0) -> None:
    """28x28 uint8 images: a fixed random template per class plus noise, in MNIST's IDX layout."""
    import numpy as np

    rng = np.random.default_rng(seed)
    templates = rng.integers(0, 256, (10, 28, 28))
    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n)
        images = np.clip(templates[labels] * 0.6 + rng.integers(0, 102, (n, 28, 28)), 0, 255)
        for stem, array in ((f"{split}-images-idx3-ubyte", images), (f"{split}-labels-idx1-ubyte", labels)):
            header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
            (raw / stem).write_bytes(header + array.astype(np.uint8).tobytes())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _engine(cfg, problem, algorithm, executor):
    from fedharness.algorithms.series import build_series
    from fedharness.runs.execute import Prepared, build_engine

    return build_engine(Prepared(cfg, problem, algorithm, None, *build_series(1)), executor)


def paired_rounds(variants: dict, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds of `local_updates` per round for each variant, on the same model and plan, in rotating order.

    `variants` maps a name to (cfg, problem, algorithm, executor, torch_threads). Interleaving the
    variants round by round, in one process, keeps other load on the machine from favouring one.
    """
    import torch

    times: dict[str, list[float]] = {name: [] for name in variants}
    states = {name: None for name in variants}
    names = list(variants)
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            cfg, problem, algorithm, executor, threads = variants[name]
            engine = _engine(cfg, problem, algorithm, executor)
            state = states[name] or engine.initial_state()
            torch.set_num_threads(threads)
            start = time.perf_counter()
            states[name] = engine.step(state)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # a GPU works asynchronously: the round ends when its kernels do
            if r >= warmup:  # the first rounds pay torch's lazy initialisation and the first client builds
                times[name].append(time.perf_counter() - start)
    return times


def cnn_child(data_dir: str, rounds: int) -> dict:
    import dataclasses

    from fedharness.core import ray_cluster
    from fedharness.config.load import load_settings
    from fedharness.core.executors import InlineExecutor
    from fedharness.backends.ray_executor import RayExecutor
    from fedharness.assembly.build import build_parts

    cores = os.cpu_count() or 1
    cfg = load_settings([*CNN, f"dataset.data_dir={data_dir}", "progress=false", "rounds=1000"])

    def on_ray(shards: int):
        return cfg.replace(executor="ray", ray=dataclasses.replace(cfg.ray, num_shards=shards))

    problem, algorithm = build_parts(cfg)
    inline = InlineExecutor(problem, algorithm.solver, 1)
    ray_cluster.start_local(num_cpus=3)  # both Ray executors at once: 3 one-CPU shards, busy one at a time
    start = time.perf_counter()
    ray1 = RayExecutor(on_ray(1), problem, algorithm.solver)
    ray_start_s = time.perf_counter() - start
    ray2 = RayExecutor(on_ray(2), problem, algorithm.solver)
    variants = {"inline, 1 thread": (cfg, problem, algorithm, inline, 1),
                f"inline, {cores} threads": (cfg, problem, algorithm, inline, cores),
                "ray, 1 shard": (cfg, problem, algorithm, ray1, 1),
                "ray, 2 shards": (cfg, problem, algorithm, ray2, 1)}
    times = paired_rounds(variants, rounds, warmup=1)
    ray1.close()
    ray2.close()
    return {"s_per_round": times, "ray_start_s": ray_start_s}


def lazy_memory_child(overrides: list[str], rounds: int) -> dict:
    """Peak resident memory of the driver and each shard over a run of `rounds` (this process alone)."""
    from fedharness.config.load import load_settings
    from fedharness.backends.ray_executor import RayExecutor
    from fedharness.assembly.build import build_parts

    after_imports = peak_rss_bytes()
    cfg = load_settings([*LAZY, *overrides, "executor=ray", "progress=false", f"rounds={rounds}"])
    problem, algorithm = build_parts(cfg)
    executor = RayExecutor(cfg, problem, algorithm.solver)
    engine = _engine(cfg, problem, algorithm, executor)
    state = engine.initial_state()
    for _ in range(rounds):
        state = engine.step(state)
    shards = executor.shard_memory()
    executor.close()
    mb = 2**20
    return {"driver_peak_mb": peak_rss_bytes() / mb, "driver_after_imports_mb": after_imports / mb,
            "shard_peak_mb": [m["peak"] / mb for m in shards],
            "shard_after_imports_mb": [m["at_start"] / mb for m in shards],
            "clients_built_by_driver": problem.generated}


def lazy_timing_child(cases: dict[str, list[str]], rounds: int) -> dict:
    from fedharness.core import ray_cluster
    from fedharness.config.load import load_settings
    from fedharness.backends.ray_executor import RayExecutor
    from fedharness.assembly.build import build_parts

    ray_cluster.start_local(num_cpus=2 * len(cases))  # every case's 2 shards at once, busy one case at a time
    variants = {}
    for name, extra in cases.items():
        cfg = load_settings([*LAZY, *extra, "executor=ray", "progress=false", "rounds=1000"])
        problem, algorithm = build_parts(cfg)
        variants[name] = (cfg, problem, algorithm, RayExecutor(cfg, problem, algorithm.solver), 1)
    times = paired_rounds(variants, rounds, warmup=3)
    for v in variants.values():
        v[3].close()
    return {"s_per_round": times}



def child(kind: str, payload: dict) -> None:
    if kind == "cnn":
        result = cnn_child(payload["data_dir"], payload["rounds"])
    elif kind == "lazy-memory":
        result = lazy_memory_child(payload["overrides"], payload["rounds"])
    else:
        result = lazy_timing_child(payload["cases"], payload["rounds"])
    print(json.dumps(result))



def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], json.loads(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed CNN rounds (lazy: 4x as many)")
    parser.add_argument("--skip-cnn", action="store_true")
    parser.add_argument("--skip-lazy", action="store_true")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    record: dict = {"host": platform.node(), "cpus": cores, "loadavg_at_start": os.getloadavg()}
    lines = [f"Ray executor benchmarks on {cores} CPU(s); load average {os.getloadavg()[0]:.1f} at start. "
             "Seconds per round are medians; ratios are of the summed paired rounds."]
    if not args.skip_cnn:
        with tempfile.TemporaryDirectory() as data:
            write_mnist_shaped(Path(data), 6000, 1000)
            cnn = run_child(__file__, "cnn", {"data_dir": data, "rounds": args.rounds})
        t = cnn["s_per_round"]
        overhead = sum(t["ray, 1 shard"]) / sum(t["inline, 1 thread"])
        fastest = min((n for n in t if n.startswith("inline")), key=lambda n: sum(t[n]))
        whole = sum(t["ray, 2 shards"]) / sum(t[fastest])
        record["cnn"] = {**cnn, "overhead_ratio": overhead, "ray2_over_fastest_inline": whole,
                         "fastest_inline": fastest}
        lines += ["", f"(a) CNN on MNIST-shaped data, K=4, 20 local steps, b=32, {args.rounds} paired rounds",
                  f"  {'':<22}{'s/round':>10}"]
        lines += [f"  {name:<22}{median(v):>10.3f}" for name, v in t.items()]
        lines += [f"  Ray overhead (1 shard / inline 1 thread, the same compute): {overhead:.2f}x (goal <= 1.3x)",
                  f"  2 shards / fastest inline ({fastest}): {whole:.2f}x; "
                  f"starting the 1-shard executor took {cnn['ray_start_s']:.1f} s"]
    if not args.skip_lazy:
        rounds = args.rounds * 4
        cases = {"N=1,000": ["dataset.num_clients=1000"],
                 "N=1,000, no cache": ["dataset.num_clients=1000", "dataset.cache_mb=0"],
                 "N=100,000": ["dataset.num_clients=100000"]}
        capped = {"N=1,000, cache 16 MB": ["dataset.num_clients=1000", "dataset.cache_mb=16"],
                  "N=100,000, cache 16 MB": ["dataset.num_clients=100000", "dataset.cache_mb=16"]}
        memory = {name: run_child(__file__, "lazy-memory", {"overrides": extra, "rounds": rounds})
                  for name, extra in {**cases, **capped}.items()}
        t = run_child(__file__, "lazy-timing", {"cases": cases, "rounds": rounds})["s_per_round"]
        ratio = sum(t["N=100,000"]) / sum(t["N=1,000"])
        ratio_uncached = sum(t["N=100,000"]) / sum(t["N=1,000, no cache"])
        record["lazy"] = {"memory": memory, "s_per_round": t, "ratio_100k_over_1k": ratio,
                          "ratio_100k_over_1k_no_cache": ratio_uncached}
        lines += ["", f"(b) synthetic_lazy, K=100, 20 local steps, b=24, ray with 2 shards, {rounds} paired rounds",
                  f"  {'':<22}{'s/round':>9}{'driver MB':>11}{'(net)':>7}{'shard MB':>16}{'(net)':>12}"]
        for name, m in memory.items():
            net = [p - a for p, a in zip(m["shard_peak_mb"], m["shard_after_imports_mb"])]
            timing = f"{median(t[name]):>9.3f}" if name in t else f"{'-':>9}"
            lines.append(f"  {name:<22}{timing}{m['driver_peak_mb']:>11.0f}"
                         f"{m['driver_peak_mb'] - m['driver_after_imports_mb']:>7.0f}"
                         f"{' / '.join(f'{v:.0f}' for v in m['shard_peak_mb']):>16}"
                         f"{' / '.join(f'{v:.0f}' for v in net):>12}")
        lines += [f"  N=100,000 / N=1,000: {ratio:.2f}x (goal <= 1.5x); "
                  f"N=100,000 / N=1,000 without the cache: {ratio_uncached:.2f}x",
                  "  (net: peak minus the process's size after its imports)"]
    publish(record, lines, "ray")


if __name__ == "__main__":
    main()
