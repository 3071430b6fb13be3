"""Threads beside other work (issue 47): one `fedharness run` at threads=1, threads=2 and the default
(`threads: null`, resolved at the run's start), on a quiet machine and beside 1 and 2 busy processes.

The workload: FedAvg with the 2NN on scikit-learn's digits (55,210 parameters; K = 10 clients a round, E = 20
local steps of b = 24: 13M multiply-adds a step, which asks for 2 threads), `--rounds` rounds, kernel=vmap (no
kernel timing), no exact reference, each run in this process as `fedharness run` makes it (`execute`: threads
resolved at the start, from the machine as it is then): the figures are the run's own seconds (its last round's
wall_s) and, beside them, those from the call's start to its end (set-up, the 0.2 s load reading and the writes
included). A repetition runs every condition in turn (quiet, 1 busy, 2 busy), and within each the three thread
settings in turn (each repetition starting with the next one), so a change in the machine's background load falls
on all of them; the figures are the medians over `--repeats` repetitions. The busy processes are
`python -c 'while True: pass'` at nice `--nice`, started 1 s before the condition's first run and ended after its
last. The machine is shared: /proc/loadavg and free_cores() (the default's own reading, a moment before the run)
are recorded with every run. Writes benchmarks/out/threads.json.

    python benchmarks/bench_threads.py [--rounds 5] [--repeats 5] [--nice 0]
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
from fedharness.config.load import load_settings
from fedharness.runs.execute import execute
from outputs import publish

WORKLOAD = ["dataset=digits", "model=2nn", "algorithm.local_steps=20", "kernel=vmap", "reference=off",
            "heterogeneity=false", "progress=false"]
THREADS = {"threads=1": ["threads=1"], "threads=2": ["threads=2"], "default": []}
CONDITIONS = {"quiet": 0, "1 busy": 1, "2 busy": 2}
BUSY = "while True: pass"


def one_run(rounds: int, extra: list[str], results: Path) -> dict:
    """One run, as `fedharness run` makes it (threads resolved at its start): its wall seconds from its set-up to
    its end, the run's own (its last round's wall_s) and the threads its runs/ row records."""
    load, free = open("/proc/loadavg").read().split()[:4], free_cores()
    start = time.perf_counter()
    result = execute(load_settings([*WORKLOAD, f"rounds={rounds}", f"eval_every={rounds}", f"results_dir={results}",
                                    *extra]))
    seconds = time.perf_counter() - start
    row = pq.read_table(results / "runs" / f"run_id={result.run_id}" / "run.parquet").to_pylist()[0]
    return {"seconds": seconds, "run_wall_s": result.rows[-1]["wall_s"],
            "threads": json.loads(row["config_json"])["threads"], "loadavg": load, "free_cores_before": free}


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
                    labels = list(THREADS)[rep % 3:] + list(THREADS)[:rep % 3]  # each goes first in turn
                    for label in labels:
                        runs[condition][label].append(one_run(args.rounds, THREADS[label], Path(tmp)))
                        print(rep, condition, label, runs[condition][label][-1], flush=True)
                finally:
                    stop(procs)
    return runs


def summary(runs: dict, args) -> tuple[dict, list[str]]:
    """Medians of the run's own seconds (the goals) and of the whole call's."""
    med = {c: {t: statistics.median(r["run_wall_s"] for r in runs[c][t]) for t in THREADS} for c in CONDITIONS}
    proc = {c: {t: statistics.median(r["seconds"] for r in runs[c][t]) for t in THREADS} for c in CONDITIONS}
    quiet1, best_quiet = med["quiet"]["threads=1"], min(med["quiet"]["threads=1"], med["quiet"]["threads=2"])
    goals = {"quiet": ("default / faster of threads=1, 2 (quiet)", med["quiet"]["default"] / best_quiet, 1.10),
             "1 busy": ("default beside 1 / threads=1 quiet", med["1 busy"]["default"] / quiet1, 1.25),
             "2 busy": ("default beside 2 / threads=1 quiet", med["2 busy"]["default"] / quiet1, 1.25 * 1.5)}
    lines = [f"bench_threads: {platform.node()}, {os.cpu_count()} CPUs, {args.rounds} rounds, medians of "
             f"{args.repeats} interleaved runs, busy processes at nice {args.nice}; the run's seconds (the whole "
             "call in brackets)", "",
             "| condition | threads=1 s | threads=2 s | default s | default's threads | default / threads=1 | goal "
             "| ratio |", "|---|---|---|---|---|---|---|---|"]
    for c in CONDITIONS:
        chosen = [r["threads"] for r in runs[c]["default"]]
        cells = " | ".join(f"{med[c][t]:.2f} ({proc[c][t]:.1f})" for t in THREADS)
        name, ratio, bound = goals[c]
        lines.append(f"| {c} | {cells} | {', '.join(map(str, chosen))} | {med[c]['default'] / med[c]['threads=1']:.3f} "
                     f"| {name} <= {bound:.3g} | {ratio:.3f} |")
    for c in CONDITIONS:
        loads = [float(r["loadavg"][0]) for t in runs[c].values() for r in t]
        lines.append(f"{c}: 1-min load average {min(loads):.2f} to {max(loads):.2f} at the runs' starts")
    record = {"host": platform.node(), "cpus": os.cpu_count(), "rounds": args.rounds, "repeats": args.repeats,
              "nice": args.nice, "workload": WORKLOAD, "median_run_seconds": med, "median_call_seconds": proc,
              "goals": {c: {"what": g[0], "ratio": g[1], "bound": g[2]} for c, g in goals.items()}, "runs": runs}
    return record, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nice", type=int, default=0, help="nice level of the busy processes")
    args = parser.parse_args()
    record, lines = summary(measure(args), args)
    publish(record, lines, "threads")


if __name__ == "__main__":
    main()
