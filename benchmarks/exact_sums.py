"""What the exact sums cost (harness/core/exact_sum.py): ms per round with exact integer sums against the
former float64 sums, alternating in one run, on W1 (benchmarks/run.py) and the smoke-size CNN
(benchmarks/models.py); and the bytes a shard's reply carries per round.

The float64 variant is the reduction as it was before exact sums (index_add of the float64 terms), put in
place for the timing only. Writes benchmarks/out/exact_sums.json.

    python benchmarks/exact_sums.py [--rounds 30] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fedharness
from fedharness.config.load import load_settings
from fedharness.core import executors
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor, ShardResult
from fedharness.assembly.build import build_parts

from models import SMOKE, noise_images
from run import W1


@dataclass
class FloatSums:
    """The former reduction: float64 partial sums, whose bits depend on the order of the additions."""

    sums: dict[str, torch.Tensor]
    updates: list = field(default_factory=list)

    @classmethod
    def zeros(cls, x: torch.Tensor) -> "FloatSums":
        return cls({"delta": torch.zeros(x.shape, dtype=torch.float64, device=x.device)})

    def add_rows(self, name: str, index: torch.Tensor, terms: torch.Tensor) -> None:
        if name not in self.sums:
            self.sums[name] = torch.zeros_like(self.sums["delta"])
        self.sums[name].index_add_(0, index, terms)

    def add(self, other: "FloatSums") -> "FloatSums":
        for name, part in other.sums.items():
            self.sums[name] = self.sums[name] + part if name in self.sums else part
        return self

    @property
    def delta(self) -> torch.Tensor:
        return self.sums["delta"]

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        return {n: v for n, v in self.sums.items() if n != "delta"}


def engine_for(overrides: list[str], rounds: int) -> tuple[Engine, object]:
    cfg = load_settings([*overrides, "progress=false"])
    problem, algorithm = build_parts(cfg)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=rounds + 1, seed=0,
                    replicas=cfg.replicas, eval_every=10**9)
    return engine, engine.step(engine.initial_state())  # warm-up round, not timed


def ms_per_round(engine: Engine, state, rounds: int, sums: type) -> float:
    executors.ShardResult = sums
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            state = engine.step(state)
        return 1e3 * (time.perf_counter() - start) / rounds
    finally:
        executors.ShardResult = ShardResult


def compare(name: str, overrides: list[str], rounds: int, repeats: int) -> dict:
    engine, state = engine_for(overrides, rounds * repeats * 2)
    times = {"exact": [], "float64": []}
    for _ in range(repeats):  # alternating, so both see the same machine load
        times["exact"].append(ms_per_round(engine, state, rounds, ShardResult))
        times["float64"].append(ms_per_round(engine, state, rounds, FloatSums))
    median = {k: statistics.median(v) for k, v in times.items()}
    dim, replicas = engine.problem.dim, len(engine.layout)
    x = torch.zeros(replicas, dim, dtype=engine.problem.dtype)
    record = {"ms_per_round": median, "all_ms": times, "exact_over_float": median["exact"] / median["float64"],
              "reply_bytes": {"exact": ShardResult.zeros(x).nbytes, "float64": replicas * dim * 8},
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
           "cnn_smoke": compare("CNN smoke", [*SMOKE, "model=cnn", "kernel=loop"], max(2, args.rounds // 10),
                                args.repeats)}
    folder = Path(__file__).parent / "out"
    folder.mkdir(exist_ok=True)
    (folder / "exact_sums.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
