"""Threads beside other work (issue 47): one `fedharness run` at threads=1, threads=2 and the default
(`threads: null`, resolved at the run's start), on a quiet machine and beside 1 and 2 busy processes.

The workload: FedAvg with the 2NN on scikit-learn's digits (55,210 parameters; K = 10 clients a round, E = 20
local steps of b = 24: 13M multiply-adds a step, which asks for 2 threads), `--rounds` rounds, kernel=vmap (no
kernel timing), no exact reference. Each figure is one whole `fedharness run` process, as a user starts it (its
imports and set-up included), timed from its start to its exit. A repetition runs every condition in turn (quiet,
1 busy, 2 busy), and within each the three thread settings in turn, so a change in the machine's background load
falls on all of them; the figures are the medians over `--repeats` repetitions. The busy processes are
`python -c 'while True: pass'` at nice `--nice`, started 1 s before the condition's first run and ended after its
last. The machine is shared: /proc/loadavg and free_cores() (the default's own reading, a moment before the run)
are recorded with every run. Writes benchmarks/out/threads.json.

    python benchmarks/bench_threads.py [--rounds 10] [--repeats 5] [--nice 0]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from fedharness.base.runtime import free_cores
from outputs import publish

WORKLOAD = ["dataset=digits", "model=2nn", "algorithm.local_steps=20", "kernel=vmap", "reference=off",
            "heterogeneity=false", "progress=false"]
THREADS = {"threads=1": ["threads=1"], "threads=2": ["threads=2"], "default": []}
CONDITIONS = {"quiet": 0, "1 busy": 1, "2 busy": 2}
BUSY = "while True: pass"


def one_run(rounds: int, extra: list[str], results: Path) -> dict:
    """One `fedharness run` process: its wall seconds, the run's own (its last round's wall_s) and the threads
    its runs/ row records."""
    load, free = open("/proc/loadavg").read().split()[:4], free_cores()
    start = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "fedharness"), "run", *WORKLOAD, f"rounds={rounds}",
                    f"eval_every={rounds}", f"results_dir={results}", *extra], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    run_dir = max((results / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    row = pq.read_table(run_dir / "run.parquet").to_pylist()[0]
    rounds_dir = results / "rounds" / run_dir.name
    last = max((r for part in rounds_dir.iterdir() for r in pq.read_table(part).to_pylist()), key=lambda r: r["round"])
    return {"seconds": seconds, "run_wall_s": last["wall_s"], "threads": json.loads(row["config_json"])["threads"],
            "loadavg": load, "free_cores_before": free}


def busy(count: int, nice: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-c", BUSY]) for _ in range(count)]
    time.sleep(1.0)  # running before the run starts
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def measure(args) -> dict[str, dict[str, list[dict]]]:
    runs: dict[str, dict[str, list[dict]]] = {c: {t: [] for t in THREADS} for c in CONDITIONS}
    with tempfile.TemporaryDirectory() as tmp:
        one_run(2, [], Path(tmp))  # untimed: the data set's first load and Python's caches
        for rep in range(args.repeats):
            for condition, count in CONDITIONS.items():
                procs = busy(count, args.nice)
                try:
                    for label, extra in THREADS.items():
                        runs[condition][label].append(one_run(args.rounds, extra, Path(tmp)))
                        print(rep, condition, label, runs[condition][label][-1], flush=True)
                finally:
                    stop(procs)
    return runs


def summary(runs: dict, args) -> tuple[dict, list[str]]:
    med = {c: {t: statistics.median(r["seconds"] for r in runs[c][t]) for t in THREADS} for c in CONDITIONS}
    quiet1, best_quiet = med["quiet"]["threads=1"], min(med["quiet"]["threads=1"], med["quiet"]["threads=2"])
    goals = {"quiet": ("default / faster of threads=1, 2 (quiet)", med["quiet"]["default"] / best_quiet, 1.10),
             "1 busy": ("default beside 1 / threads=1 quiet", med["1 busy"]["default"] / quiet1, 1.25),
             "2 busy": ("default beside 2 / threads=1 quiet", med["2 busy"]["default"] / quiet1, 1.25 * 1.5)}
    lines = [f"bench_threads: {platform.node()}, {os.cpu_count()} CPUs, {args.rounds} rounds, medians of "
             f"{args.repeats} interleaved runs, busy processes at nice {args.nice}", "",
             "| condition | threads=1 s | threads=2 s | default s (threads chosen) | goal | ratio |", "|---|---|---|---|---|---|"]
    for c in CONDITIONS:
        chosen = sorted({r["threads"] for r in runs[c]["default"]})
        name, ratio, bound = goals[c]
        lines.append(f"| {c} | {med[c]['threads=1']:.2f} | {med[c]['threads=2']:.2f} | {med[c]['default']:.2f} "
                     f"({'/'.join(map(str, chosen))}) | {name} <= {bound:.3g} | {ratio:.3f} |")
    loads = [float(r["loadavg"][0]) for c in runs.values() for t in c.values() for r in t]
    lines.append(f"\n1-min load average over the runs: {min(loads):.2f} to {max(loads):.2f}")
    record = {"host": platform.node(), "cpus": os.cpu_count(), "rounds": args.rounds, "repeats": args.repeats,
              "nice": args.nice, "workload": WORKLOAD, "median_seconds": med,
              "goals": {c: {"what": g[0], "ratio": g[1], "bound": g[2]} for c, g in goals.items()}, "runs": runs}
    return record, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nice", type=int, default=0, help="nice level of the busy processes")
    args = parser.parse_args()
    record, lines = summary(measure(args), args)
    publish(record, lines, "threads")


if __name__ == "__main__":
    main()
