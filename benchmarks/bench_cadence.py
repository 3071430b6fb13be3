"""Issue 52: what the cadence refactor costs. A W1 synchronous round and a FedBuff step through the cadence the
engine delegates to, against the code before it (a checkout of the main branch, run with its own interpreter):
paired child processes, each pair one "before" and one "after" in alternating order, each child timing `--steps`
engine steps after 3 warm-up steps and reporting its median step in wall-clock and in the process's CPU time (one
thread: CPU time is what the code path costs, less disturbed by other processes on a busy machine); the table gives
each side's median over the pairs and the median of the per-pair ratios after / before, of each.

Cases (conf/sweep/compression.yaml's W1: Synthetic(1,1), 100 clients x 200 samples, logistic regression, K = 10;
one thread, inline, one shard, no evaluation):
  w1_sync      synchronous FedAvg, no systems keys: Engine.step -> the contract's step -> plan, train, count, step
  fedbuff_c20  yang_s2, lognormal speeds and links (sigma 0.5), FedBuff with C = 20, M = 10 (docs/async.md's W1)

    python benchmarks/bench_cadence.py --before /work/main [--pairs 7 --steps 60]

Prints a table and writes benchmarks/out/cadence.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
COMMON = ["threads=1", "progress=false", "heterogeneity=false", "eval_every=1000000", "rounds=1000000",
          "reference=off"]
W1 = ["dataset=synthetic", "dataset.num_clients=100", "dataset.samples_per_client=200", "dataset.data_seed=0",
      "algorithm.clients_per_round=10"]
LATE = ["network.compute_s_per_step=0.05", "network.bandwidth_MB_per_s=0.01"]
# each case's overrides in the spelling of each side: the keys moved from `systems` to the groups (issue 52)
CASES = {
    "w1_sync": {"before": W1, "after": W1},
    "fedbuff_c20": {
        "before": [*W1, "algorithm.sampler=yang_s2", *LATE, "systems.speed=lognormal", "systems.speed_sigma=0.5",
                   "systems.bandwidth_sigma=0.5", "systems.mode=fedbuff", "systems.concurrency=20",
                   "systems.buffer=10"],
        "after": [*W1, "algorithm.sampler=yang_s2", *LATE, "speed=lognormal", "speed.step_sigma=0.5",
                  "speed.bandwidth_sigma=0.5", "cadence=fedbuff", "cadence.concurrency=20", "cadence.buffer=10"]},
}
WARMUP = 3


def child(overrides: list[str], steps: int) -> dict:
    """In this process (whichever checkout its interpreter imports): the median seconds of one engine step."""
    from fedharness.config.load import load_settings
    from fedharness.core.executors import InlineExecutor
    from fedharness.runs.execute import build_engine, prepare_run

    run = prepare_run(load_settings([*COMMON, *overrides]))
    engine = build_engine(run, InlineExecutor(run.problem, run.algorithm.solver, 1))
    state = engine.initial_state()
    for _ in range(WARMUP):
        state = engine.step(state)
    times, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        state = engine.step(state)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    import fedharness

    return {"median_s": statistics.median(times), "median_cpu_s": statistics.median(cpu), "package": fedharness.__file__,
            "sim_s": float(state.counters["sim_s"].max()), "round": state.round}


def timed(side: str, checkout: Path, case: str, steps: int) -> dict:
    """One child process of `side` (its checkout's own interpreter, in its folder)."""
    python = checkout / ".venv" / "bin" / "python"
    out = subprocess.run([str(python), str(HERE), "--child", json.dumps(CASES[case][side]), "--steps", str(steps)],
                         cwd=checkout, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="the checkout before the change (its .venv is used)")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child), args.steps)))
        return
    sides = {"before": args.before.resolve(), "after": ROOT}
    record: dict = {"pairs": args.pairs, "steps": args.steps, "loadavg_start": os.getloadavg()}
    lines = [f"{'case':<13} {'before ms':>10} {'after ms':>10} {'after/before':>13} {'CPU before':>11} "
             f"{'CPU after':>10} {'CPU a/b':>8}  (median of {args.pairs} pairs)"]
    for case in CASES:
        pairs = []
        for i in range(args.pairs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            got = {side: timed(side, sides[side], case, args.steps) for side in order}
            assert got["before"]["package"] != got["after"]["package"], got  # two checkouts, not one twice
            # the same simulated clock and steps: the two sides ran the same run
            assert got["before"]["sim_s"] == got["after"]["sim_s"], got
            pairs.append(got)
        before = statistics.median(p["before"]["median_s"] for p in pairs)
        after = statistics.median(p["after"]["median_s"] for p in pairs)
        ratio = statistics.median(p["after"]["median_s"] / p["before"]["median_s"] for p in pairs)
        cpu = {side: statistics.median(p[side]["median_cpu_s"] for p in pairs) for side in sides}
        cpu_ratio = statistics.median(p["after"]["median_cpu_s"] / p["before"]["median_cpu_s"] for p in pairs)
        record[case] = {"before_s": before, "after_s": after, "ratio": ratio, "cpu_before_s": cpu["before"],
                        "cpu_after_s": cpu["after"], "cpu_ratio": cpu_ratio, "pairs": pairs}
        lines.append(f"{case:<13} {before * 1e3:>10.3f} {after * 1e3:>10.3f} {ratio:>13.4f} "
                     f"{cpu['before'] * 1e3:>11.3f} {cpu['after'] * 1e3:>10.3f} {cpu_ratio:>8.4f}")
    record["loadavg_end"] = os.getloadavg()
    print("\n".join(lines))
    print(f"load average: start {record['loadavg_start']}, end {record['loadavg_end']}")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "cadence.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
