"""Cross-device populations: set-up, round time and memory of dataset=synthetic_lazy at N = 10^3, 10^6, 10^8.

Every case: Synthetic(1,1) with fixed sizes (200 samples a client) or the natural lognormal(4, 2) + 50 sizes,
logistic regression, scheme I (K = 100 draws by n_k), 20 local steps of b = 24, 1 torch thread,
dataset.cache_mb=0, inline or the Ray executor with 2 shards. Each case runs in its own process (with its
own local Ray on 127.0.0.1): set-up seconds (building the problem and the executor: the sizes' block sums, the
shards' ranges, the Ray shards building theirs), milliseconds per round (median of the timed rounds, after
warm-up) and peak resident memory of the driver (and of each Ray shard).

The ratios against N = 10^3 come from a separate paired run: the inline cases live in one process and take
turns round by round on the same model, so load from other work on the machine hits them alike.

Goals: at N = 10^8, set-up <= 10 s, peak memory <= 2 GB, ms per round <= 1.2x that of N = 10^3, and the
lognormal-size round within 1.5x the fixed-size round. Prints a table and writes benchmarks/out/population.json.

    python benchmarks/bench_population.py [--rounds 10] [--skip-ray] [--sizes 1e3,1e6,1e8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

from statistics import median

from children import run_child
from outputs import publish

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
COMMON = ["dataset=synthetic_lazy", "model=logreg", "dataset.cache_mb=0", "algorithm.sampler=scheme_i",
          "algorithm.clients_per_round=100", "algorithm.local_steps=20", "algorithm.batch_size=24",
          "algorithm.client_lr=0.05", "heterogeneity=false", "progress=false", "rounds=100000"]
SIZES = {"fixed": ["dataset.samples_per_client=200"], "lognormal": ["dataset.samples_per_client=null"]}
WARMUP = 2


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def overrides(n: int, sizes: str) -> list[str]:
    return [*COMMON, *SIZES[sizes], f"dataset.num_clients={n}"]


def _engine(cfg, problem, algorithm, executor):
    from fedharness.algorithms.series import build_series
    from fedharness.runs.execute import Prepared, build_engine

    return build_engine(Prepared(cfg, problem, algorithm, None, *build_series(1)), executor)


def case_child(n: int, sizes: str, executor: str, rounds: int) -> dict:
    """One case alone in this process: set-up seconds, ms per round, peak memory."""
    import torch

    from fedharness.config.load import load_settings
    from fedharness.core.executors import InlineExecutor
    from fedharness.assembly.build import build_parts

    torch.set_num_threads(1)
    after_imports = peak_rss_bytes()
    extra = ["executor=ray", "ray.num_shards=2"] if executor == "ray" else []
    cfg = load_settings([*overrides(n, sizes), *extra])
    if executor == "ray":  # Ray's own start is not the population's set-up
        from fedharness.core import ray_cluster

        ray_cluster.start_local(num_cpus=2)
    start = time.perf_counter()
    problem, algorithm = build_parts(cfg)
    problem_s = time.perf_counter() - start
    if executor == "ray":
        from fedharness.backends.ray_executor import RayExecutor

        runner = RayExecutor(cfg, problem, algorithm.solver)
    else:
        runner = InlineExecutor(problem, algorithm.solver, 1)
    setup_s = time.perf_counter() - start
    engine = _engine(cfg, problem, algorithm, runner)
    state = engine.initial_state()
    times = []
    for r in range(WARMUP + rounds):
        t = time.perf_counter()
        state = engine.step(state)
        if r >= WARMUP:
            times.append(time.perf_counter() - t)
    shards = runner.shard_memory() if executor == "ray" else []
    if executor == "ray":
        runner.close()
    mb = 2**20
    return {"problem_s": problem_s, "setup_s": setup_s, "ms_per_round": 1000 * median(times),
            "driver_peak_mb": peak_rss_bytes() / mb, "driver_after_imports_mb": after_imports / mb,
            "shard_peak_mb": [m["peak"] / mb for m in shards],
            "population_bytes": int(getattr(problem.sizes, "nbytes", lambda: 0)())}


def paired_child(cases: list[list], rounds: int) -> dict:
    """Seconds per round of inline cases taking turns round by round in this one process, and the mean number
    of distinct clients a round trains (scheme I's K = 100 draws repeat the largest clients of a small N)."""
    import numpy as np
    import torch

    from fedharness.config.load import load_settings
    from fedharness.core.executors import InlineExecutor
    from fedharness.assembly.build import build_parts

    torch.set_num_threads(1)
    variants, distinct = {}, {}
    for n, sizes in cases:
        cfg = load_settings(overrides(n, sizes))
        problem, algorithm = build_parts(cfg)
        engine = _engine(cfg, problem, algorithm, InlineExecutor(problem, algorithm.solver, 1))
        variants[f"{n}/{sizes}"] = [engine, engine.initial_state()]
        distinct[f"{n}/{sizes}"] = float(np.mean([len(np.unique(algorithm.sampler.select(
            cfg.seed, np.zeros(1, dtype=np.int64), r, problem.weights).clients)) for r in range(WARMUP + rounds)]))
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(WARMUP + rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            engine, state = variants[name]
            t = time.perf_counter()
            variants[name][1] = engine.step(state)
            if r >= WARMUP:
                times[name].append(time.perf_counter() - t)
    return {"s_per_round": times, "distinct_clients": distinct}




def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        payload = json.loads(sys.argv[3])
        if sys.argv[2] == "case":
            result = case_child(payload["n"], payload["sizes"], payload["executor"], payload["rounds"])
        else:
            result = paired_child(payload["cases"], payload["rounds"])
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per case (paired run: 2x as many)")
    parser.add_argument("--sizes", default="1e3,1e6,1e8", help="the N to measure, comma-separated")
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    ns = [int(float(v)) for v in args.sizes.split(",")]
    executors = ["inline"] if args.skip_ray else ["inline", "ray"]
    record: dict = {"host": platform.node(), "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
                    "cases": {}}
    lines = [f"dataset=synthetic_lazy on {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f} at start; "
             f"K=100 (scheme I), 20 local steps of b=24, cache off, 1 thread; {args.rounds} timed rounds a case",
             f"  {'N':>11} {'sizes':<10}{'executor':<9}{'set-up s':>9}{'ms/round':>10}{'driver MB':>11}"
             f"{'shards MB':>13}{'population':>12}"]
    for executor in executors:
        for sizes in SIZES:
            for n in ns:
                m = run_child(__file__, "case", {"n": n, "sizes": sizes, "executor": executor, "rounds": args.rounds},
                              CHILD_ENV)
                record["cases"][f"{n}/{sizes}/{executor}"] = m
                shards = " / ".join(f"{v:.0f}" for v in m["shard_peak_mb"]) or "-"
                lines.append(f"  {n:>11,} {sizes:<10}{executor:<9}{m['setup_s']:>9.2f}{m['ms_per_round']:>10.1f}"
                             f"{m['driver_peak_mb']:>11.0f}{shards:>13}{m['population_bytes'] / 1e6:>10.2f}MB")
    out = run_child(__file__, "paired", {"cases": [[n, s] for s in SIZES for n in (ns[0], ns[-1])],
                                         "rounds": 2 * args.rounds}, CHILD_ENV)
    paired, distinct = out["s_per_round"], out["distinct_clients"]
    record["paired_s_per_round"], record["distinct_clients"] = paired, distinct
    small, large = ns[0], ns[-1]
    ratios = {s: sum(paired[f"{large}/{s}"]) / sum(paired[f"{small}/{s}"]) for s in SIZES}
    lognormal_over_fixed = sum(paired[f"{large}/lognormal"]) / sum(paired[f"{large}/fixed"])
    per_client = {s: ratios[s] * distinct[f"{small}/{s}"] / distinct[f"{large}/{s}"] for s in SIZES}
    record.update(ratio_large_over_small=ratios, lognormal_over_fixed=lognormal_over_fixed,
                  ratio_per_distinct_client=per_client)
    lines += ["", f"  paired inline rounds ({2 * args.rounds} each, medians in ms): "
              + ", ".join(f"N={k}: {1000 * median(v):.1f}" for k, v in paired.items()),
              "  distinct clients trained per round: "
              + ", ".join(f"N={k}: {v:.1f}" for k, v in distinct.items()),
              *(f"  N={large:,} / N={small:,} ({s} sizes): {r:.2f}x a round (goal <= 1.2x), "
                f"{per_client[s]:.2f}x a distinct client" for s, r in ratios.items()),
              f"  lognormal / fixed sizes at N={large:,}: {lognormal_over_fixed:.2f}x (goal <= 1.5x)",
              "  population: bytes the problem holds for all N clients (the sizes' block sums)"]
    publish(record, lines, "population")


if __name__ == "__main__":
    main()
