"""A W1 round (benchmarks/run.py) with no update stage against the same round in another checkout (the code before
the update stages, issue 37): paired runs, each pair one process of each checkout, their order alternating from
pair to pair, the median of the pairs' ratios.

Each process runs W1 three times (3R rounds, evaluated every R, 1 thread) and reports the best run's ms per round
over rounds R+1..3R, from the wall clock its rows record: the set-up and the first rounds left out.

    python benchmarks/bench_stages.py --baseline /path/to/old/checkout/.venv/bin/python [--pairs 7 --rounds 20]

Make a baseline checkout with `git worktree add --detach ../before <commit>` and a venv in it that has the
same packages (a `.pth` file pointing at this checkout's site-packages, then `pip install --no-deps -e .`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys
from fedharness.config.load import load_settings
from fedharness.runs.execute import execute
W1 = {w1!r}
s = load_settings([*W1, "rounds={rounds3}", "eval_every={rounds}", "progress=false", "threads=1", "reference=off",
                   "heterogeneity=false", "results_dir={out}"])
best = float("inf")
for _ in range(3):  # the best of three runs in this process: the others' spikes left out
    wall = {{r["round"]: r["wall_s"] for r in execute(s).rows}}
    best = min(best, (wall[{rounds3}] - wall[{rounds}]) / (2 * {rounds}))  # rounds R+1..3R, one evaluation each end
print(json.dumps({{"ms_per_round": 1e3 * best}}))
"""


def ms_per_round(python: str, rounds: int, out: str) -> float:
    sys.path.insert(0, os.path.dirname(__file__))
    from run import W1

    code = CHILD.format(w1=W1, rounds=rounds, rounds3=3 * rounds, out=out)
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ms_per_round"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the python of the checkout to compare with")
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out", default="/tmp/fedharness-bench-stages")
    args = parser.parse_args()
    ratios = []
    print(f"W1, {3 * args.rounds} rounds a run, best of 3 a process, 1 thread; load average {os.getloadavg()[0]:.2f} at the start")
    for i in range(args.pairs):
        order = [("baseline", args.baseline), ("this", sys.executable)]
        if i % 2:
            order.reverse()
        ms = {name: ms_per_round(python, args.rounds, f"{args.out}/{name}") for name, python in order}
        ratios.append(ms["this"] / ms["baseline"])
        print(f"pair {i + 1}: baseline {ms['baseline']:.1f} ms/round, this {ms['this']:.1f} ms/round, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    print(f"median ratio (this / baseline) over {len(ratios)} pairs: {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
