"""What the exact sums cost (harness/core/exact_sum.py): ms per round with exact integer sums against the
former float64 sums, alternating in one run, on W1 (benchmarks/run.py) and the smoke-size CNN
(benchmarks/models.py); and the bytes a shard's reply carries per round.

The float64 variant is `sums: float` (index_add of the float64 terms, the reduction as it was before exact
sums), on a second executor the same engine alternates with. Writes benchmarks/out/exact_sums.json.

    python benchmarks/exact_sums.py [--rounds 30] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import fedharness
from fedharness.config.load import load_settings
from fedharness.algorithms.series import build_series
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.assembly.build import build_parts
from fedharness.runs.execute import Prepared, build_engine

from models import SMOKE, noise_images
from run import W1


def engine_for(overrides: list[str], rounds: int) -> tuple[Engine, object, dict[str, InlineExecutor]]:
    cfg = load_settings([*overrides, "progress=false"])
    problem, algorithm = build_parts(cfg)
    executors = {"exact": InlineExecutor(problem, algorithm.solver),
                 "float64": InlineExecutor(problem, algorithm.solver, exact_sums=False)}
    engine = build_engine(Prepared(cfg, problem, algorithm, None, *build_series(cfg.replicas)), executors["exact"])
    return engine, engine.step(engine.initial_state()), executors  # warm-up round, not timed


def ms_per_round(engine: Engine, state, rounds: int, executor: InlineExecutor) -> float:
    engine.executor = executor
    start = time.perf_counter()
    for _ in range(rounds):
        state = engine.step(state)
    return 1e3 * (time.perf_counter() - start) / rounds


def reply_bytes(engine: Engine, state, executor: InlineExecutor) -> int:
    """The bytes of one shard's sums after a round (a Ray shard's reply, besides the per-client scalars)."""
    plan, _ = engine.plan_round(state.round)
    plan.server_ctx = state.server_ctx
    return executor.shards[0].train(state.x, plan).reply().nbytes


def compare(name: str, overrides: list[str], rounds: int, repeats: int) -> dict:
    engine, state, executors = engine_for(overrides, rounds * repeats * 2)
    times = {"exact": [], "float64": []}
    for _ in range(repeats):  # alternating, so both see the same machine load
        for kind, executor in executors.items():
            times[kind].append(ms_per_round(engine, state, rounds, executor))
    median = {k: statistics.median(v) for k, v in times.items()}
    dim, replicas = engine.problem.dim, len(engine.layout)
    record = {"ms_per_round": median, "all_ms": times, "exact_over_float": median["exact"] / median["float64"],
              "reply_bytes": {k: reply_bytes(engine, state, e) for k, e in executors.items()},
              "dim": dim, "replicas": replicas}
    print(f"{name}: exact {median['exact']:.2f} ms/round, float64 {median['float64']:.2f} ms/round "
          f"({record['exact_over_float']:.3f}x); a shard's reply {record['reply_bytes']['exact']:,} bytes "
          f"vs {record['reply_bytes']['float64']:,} (dim {dim}, {replicas} replica(s))")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fedharness.register_dataset("noise_images", noise_images, num_clients=10)
    out = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
           "W1": compare("W1", W1, args.rounds, args.repeats),
           "cnn_smoke": compare("CNN smoke", [*SMOKE, "model=cnn", "kernel=loop"], max(2, args.rounds // 3),
                                args.repeats)}
    folder = Path(__file__).parent / "out"
    folder.mkdir(exist_ok=True)
    (folder / "exact_sums.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
