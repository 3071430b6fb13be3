"""Engine benchmarks (workload W1 of the engine issue), measured as ratios within one run.

W1: Synthetic(1,1)-like, N=100 clients x 200 samples, 60 features, 10 classes, K=10, E=20 local
steps, b=24, lr 0.05. Prints seconds per round in steady state (the first round, which pays
torch's lazy initialisation, is left out), the milliseconds of one evaluation (problem.evaluate: loss and
gradient over the 18,000 training samples, loss and accuracy over the 2,000 test samples) of 1 and of 64
replicas' models, with and without the gradient (eval.grad_norm), and writes benchmarks/out/engine.json.

    python benchmarks/run.py [--rounds 30] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fedharness.config.load import load_settings
from fedharness.core.executors import InlineExecutor, LoopExecutor
from fedharness.runs.execute import build_engine, prepare_run

W1 = ["dataset.samples_per_client=200", "dataset.num_clients=100", "algorithm.clients_per_round=10",
      "algorithm.local_steps=20", "algorithm.batch_size=24", "algorithm.client_lr=0.05"]


def seconds_per_round(executor_cls, replicas: int, rounds: int) -> float:
    cfg = load_settings([*W1, f"replicas={replicas}"])
    run = prepare_run(cfg)
    engine = build_engine(run, executor_cls(run.problem, run.algorithm.solver))
    state = engine.step(engine.initial_state())  # warm-up round, not timed
    start = time.perf_counter()
    for _ in range(rounds):
        state = engine.step(state)
    return (time.perf_counter() - start) / rounds


def evaluate_ms(replicas: int, repeats: int, grad_norm: bool = True) -> float:
    """Milliseconds of one problem.evaluate of `replicas` models (random weights, seeded), after a warm-up call;
    grad_norm=False: without the full gradient (eval.grad_norm=false, tuning trials' default)."""
    problem = prepare_run(load_settings([*W1, f"replicas={replicas}"])).problem
    w = 0.1 * torch.randn(replicas, problem.dim, generator=torch.Generator().manual_seed(0)).to(problem.dtype)
    problem.evaluate(w, grad_norm)
    start = time.perf_counter()
    for _ in range(repeats):
        problem.evaluate(w, grad_norm)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs = {
        "vectorized, 1 replica": seconds_per_round(InlineExecutor, 1, args.rounds),
        "per-client loop, 1 replica": seconds_per_round(LoopExecutor, 1, max(3, args.rounds // 10)),
        "vectorized, 64 replicas": seconds_per_round(InlineExecutor, 64, max(3, args.rounds // 3)),
    }
    evaluation = {replicas: evaluate_ms(replicas, repeats) for replicas, repeats in ((1, 50), (64, 5))}
    loss_alone = {replicas: evaluate_ms(replicas, repeats, False) for replicas, repeats in ((1, 50), (64, 5))}
    speedup = runs["per-client loop, 1 replica"] / runs["vectorized, 1 replica"]
    replica_ratio = runs["vectorized, 64 replicas"] / runs["vectorized, 1 replica"]
    print(f"W1 on {platform.processor() or platform.machine()}, torch threads={args.threads}")
    for name, sec in runs.items():
        print(f"  {name:<30}{sec * 1e3:10.2f} ms/round")
    print(f"  vectorized vs per-client loop: {speedup:.1f}x faster (goal >= 10x)")
    print(f"  64 replicas vs 1: {replica_ratio:.1f}x the time (goal <= 16x), "
          f"{64 / replica_ratio:.1f}x cheaper per seed")
    print(f"  evaluate (full training loss and gradient, test set): {evaluation[1]:.2f} ms at 1 replica, "
          f"{evaluation[64]:.1f} ms at 64 ({evaluation[64] / evaluation[1]:.1f}x)")
    print(f"  evaluate without the gradient (eval.grad_norm=false): {loss_alone[1]:.2f} ms at 1 replica "
          f"({evaluation[1] / loss_alone[1]:.2f}x faster), {loss_alone[64]:.1f} ms at 64 "
          f"({evaluation[64] / loss_alone[64]:.2f}x faster)")
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    record = {"workload": "W1", "threads": args.threads, "ms_per_round": {k: v * 1e3 for k, v in runs.items()},
              "speedup_vs_loop": speedup, "replicas64_over_1": replica_ratio,
              "evaluate_ms": {str(k): v for k, v in evaluation.items()},
              "evaluate_ms_without_grad_norm": {str(k): v for k, v in loss_alone.items()}}
    (out / "engine.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
