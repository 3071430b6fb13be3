"""Compressed updates' cost: a round of the 2NN on digits with top-k at 1% (error feedback on, topk's default)
against the same round uncompressed, paired as benchmarks/bench_stages.py pairs two checkouts: each pair one process
of each configuration back to back, their order alternating from pair to pair, the median of the pairs' ratios.

Each process is bench_stages.py's child with this workload in place of W1: it runs 3R rounds three times (evaluated
every R, 1 thread) and reports the best run's ms per round over rounds R+1..3R from the wall clock its rows record
(the set-up and the first rounds left out). bytes_up comes from the rounds/ Parquet rows each run writes: the last
round's cumulative bytes_up of top-k over that of the uncompressed run (the same seed samples the same clients).
`--ef-pairs` pairs of top-k with error feedback off against on follow (0: none).

    python benchmarks/bench_compression.py [--pairs 7 --rounds 20 --ef-pairs 5]

Writes benchmarks/out/compression.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(__file__))
from bench_stages import CHILD  # noqa: E402
from outputs import publish  # noqa: E402

# McMahan et al.'s 2NN (64 inputs: digits' 8x8 pixels, two hidden layers of 200, 10 classes: d = 55,210) on
# scikit-learn's digits over 20 clients (no download), K = 10 clients a round, E = 20 local steps of b = 24, float32.
WORKLOAD = ["dataset=digits", "model=2nn", "algorithm.clients_per_round=10", "algorithm.local_steps=20",
            "algorithm.batch_size=24", "algorithm.client_lr=0.05", "dtype=float32"]
CONFIGS = {
    "none": ["compress=none"],
    "topk": ["compress=topk", "compress.ratio=0.01"],  # error feedback on: conf/compress/topk.yaml's default
    "topk_ef_off": ["compress=topk", "compress.ratio=0.01", "compress.error_feedback=false"],
}


def bytes_up(results_dir: str) -> list[int]:
    """Each run's bytes_up at its last round (cumulative, series iterate), from the rounds/ Parquet rows."""
    runs = []
    for part_dir in sorted((Path(results_dir) / "rounds").glob("run_id=*")):
        rows = [r for f in sorted(part_dir.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
        last = max(r["round"] for r in rows)
        runs.append(max(int(r["bytes_up"]) for r in rows if r["round"] == last and r["series"] == "iterate"))
    return runs


def measure(config: str, rounds: int) -> dict:
    """One process: bench_stages.CHILD's best-of-three ms/round, and its runs' bytes_up from their Parquet rows."""
    with tempfile.TemporaryDirectory(prefix="fedharness-bench-compression-") as out:
        code = CHILD.format(w1=[*WORKLOAD, *CONFIGS[config]], rounds=rounds, rounds3=3 * rounds, out=out)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{config} failed:\n{done.stderr[-3000:]}")
        up = bytes_up(out)
    if len(set(up)) != 1:
        raise RuntimeError(f"{config}: the three runs' bytes_up differ: {up}")
    return {"ms_per_round": json.loads(done.stdout.strip().splitlines()[-1])["ms_per_round"], "bytes_up": up[0]}


def paired(a: str, b: str, pairs: int, rounds: int, lines: list[str]) -> dict:
    """`pairs` pairs of processes a and b, alternating which goes first; b / a per pair and their median."""
    results = []
    for i in range(pairs):
        order = [a, b] if i % 2 == 0 else [b, a]
        ms = {name: measure(name, rounds) for name in order}
        ratio = ms[b]["ms_per_round"] / ms[a]["ms_per_round"]
        results.append({"first": order[0], a: ms[a], b: ms[b], "ratio": ratio})
        line = (f"| {i + 1} | {order[0]} | {ms[a]['ms_per_round']:.2f} | {ms[b]['ms_per_round']:.2f} | "
                f"{ratio:.3f} | {ms[b]['bytes_up'] / ms[a]['bytes_up']:.4f} |")
        lines.append(line)
        print(line, flush=True)
    ratios = [r["ratio"] for r in results]
    up = {r[b]["bytes_up"] / r[a]["bytes_up"] for r in results}
    summary = {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
               f"median_ms_{a}": statistics.median(r[a]["ms_per_round"] for r in results),
               f"median_ms_{b}": statistics.median(r[b]["ms_per_round"] for r in results),
               "bytes_up_ratio": sorted(up), "pairs": results}
    lines.append(f"{b} / {a}: median {summary['median_ratio']:.3f} over {pairs} pairs (min {min(ratios):.3f}, "
                 f"max {max(ratios):.3f}); median ms/round {summary[f'median_ms_{a}']:.2f} vs "
                 f"{summary[f'median_ms_{b}']:.2f}; bytes_up {b} / {a}: {', '.join(f'{u:.4f}' for u in sorted(up))}")
    print(lines[-1], flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=20, help="R: each run is 3R rounds, timed over R+1..3R")
    parser.add_argument("--ef-pairs", type=int, default=5, help="pairs of error feedback off vs on (0: none)")
    args = parser.parse_args()
    load = os.getloadavg()
    lines = [f"2NN on digits, K=10, E=20, b=24, float32, {3 * args.rounds} rounds a run (timed over rounds "
             f"{args.rounds + 1}-{3 * args.rounds}), best of 3 a process, 1 thread; load average "
             f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start", "",
             "| pair | first | none, ms/round | topk 1% + EF, ms/round | topk / none | bytes_up topk / none |",
             "|---:|---|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    record = {"workload": WORKLOAD, "configs": CONFIGS, "rounds": 3 * args.rounds, "timed_rounds":
              [args.rounds + 1, 3 * args.rounds], "threads": 1, "loadavg_at_start": load,
              "topk_vs_none": paired("none", "topk", args.pairs, args.rounds, lines)}
    if args.ef_pairs:
        lines += ["", "| pair | first | topk EF off, ms/round | topk EF on, ms/round | on / off | bytes_up on / off |",
                  "|---:|---|---:|---:|---:|---:|"]
        print("\n".join(lines[-3:]), flush=True)
        record["ef_on_vs_off"] = paired("topk_ef_off", "topk", args.ef_pairs, args.rounds, lines)
    lines.append(f"load average {os.getloadavg()[0]:.2f} at the end")
    print("\n" * 2 + "summary:", flush=True)
    publish(record, lines, "compression")


if __name__ == "__main__":
    main()
