"""What a sweep costs with the driver as the writer (harness/backends/results_writer.py) against direct writes.

A real two-node Ray cluster on 127.0.0.1 (ray.cluster_utils.Cluster: a raylet per node, 1 CPU each) runs a sweep
of `--runs` small runs (quadratic, dim 50, `--rounds` rounds, every round evaluated, a checkpoint every 5 rounds:
each run writes its meta, a state.pt and a rounds/ part per checkpoint, and its run row twice) with
`fedharness.studies.sweep.run_sweep`, two ways:

* driver: as fedharness runs it, every task's write goes through the ResultsWriter actor on the driver's node;
* direct: as before the driver was the writer, each task writes `results_dir` itself (here the nodes share one
  disk, so that works; on a cluster without a shared folder it loses the rows).

The two take turns (driver, direct, driver, ...) after one untimed warm-up sweep that starts the worker processes,
each into a fresh folder, so load from other work on the machine hits them alike. Prints the wall time of each
sweep, the medians and their ratio, and writes benchmarks/out/results_writer.json.

    python benchmarks/bench_results_writer.py [--runs 20] [--rounds 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

OUT = Path(__file__).parent / "out"
RUN = {"dataset": "quadratic", "dataset.num_clients": 12, "dataset.dim": 50, "dataset.curvature": "diagonal",
       "dtype": "float64", "replicas": 2, "algorithm.local_steps": 4, "algorithm.clients_per_round": 5,
       "heterogeneity": False, "eval_every": 1, "checkpoint_every": 5}


@contextmanager
def direct_writes(store):
    """results_writer.driver_store's stand-in for the direct path: the tasks get no store and open their own."""
    yield None


def sweep_seconds(results_dir: Path, runs: int, rounds: int) -> tuple[float, int]:
    """Wall time of one sweep of `runs` runs, and how many objects it wrote."""
    from fedharness.studies.sweep import run_sweep, spec_from_dict

    spec = spec_from_dict({"name": "writer", "results_dir": str(results_dir), "base": {**RUN, "rounds": rounds},
                           "grid": {"seed": list(range(runs))}}, "writer")
    start = time.perf_counter()
    result = run_sweep(spec, echo=lambda line: None)
    seconds = time.perf_counter() - start
    errors = [o.error for o in result.outcomes.values() if o.error]
    assert result.counts() == {"ok": runs}, (result.counts(), errors[:1])
    return seconds, sum(1 for p in results_dir.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="timed sweeps of each way")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray
    from ray.cluster_utils import Cluster

    from fedharness.backends import results_writer
    from fedharness.core import ray_cluster

    with ray_cluster.loopback_only():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray_cluster.connect(cluster.address)
    driver_store = results_writer.driver_store
    ways = {"driver": driver_store, "direct": direct_writes}
    times: dict[str, list[float]] = {way: [] for way in ways}
    written: dict[str, int] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-writer-") as tmp:
            sweep_seconds(Path(tmp) / "warm-up", args.runs, args.rounds)
            for i in range(args.repeats):
                for way, opener in ways.items():
                    results_writer.driver_store = opener
                    seconds, written[way] = sweep_seconds(Path(tmp) / f"{way}-{i}", args.runs, args.rounds)
                    times[way].append(seconds)
                    print(f"{way:<7} sweep {i + 1}: {seconds:6.2f} s ({written[way]} files)", flush=True)
    finally:
        results_writer.driver_store = driver_store
        ray.shutdown()
        cluster.shutdown()
    median = {way: statistics.median(t) for way, t in times.items()}
    ratio = median["driver"] / median["direct"]
    print(f"\n{args.runs} runs x {args.rounds} rounds over 2 nodes (1 CPU each), median of {args.repeats}:")
    print(f"{'writer':<8}{'wall s':>9}{'files':>7}")
    for way in ways:
        print(f"{way:<8}{median[way]:>9.2f}{written[way]:>7}")
    print(f"driver / direct = {ratio:.3f}")
    OUT.mkdir(exist_ok=True)
    (OUT / "results_writer.json").write_text(json.dumps({
        "runs": args.runs, "rounds": args.rounds, "repeats": args.repeats, "seconds": times, "median_s": median,
        "ratio_driver_over_direct": ratio, "files_per_sweep": written, "host": platform.node(),
        "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
