"""A Ditto round (algorithms/personal.py DittoSGD) at K = 10 clients on the 2NN, batched against client by client.

digits (1,797 samples of 64 pixels, 100 clients iid), the 2NN (64-200-200-10: 55,210 parameters, float32),
Ditto with lambda 0.1, K = 10 clients a round (scheme_ii), E = `--steps` local steps of batch 24, 1 torch thread.
Each local step takes two gradients per client: the global copy's and the personal model's.

* `batched`: the product's path (executor=inline): the round's 10 clients as one batched computation, the global
  copies and the personal models each one batched gradient a step; the personal models read from and written to
  the client store (core/client_store.py) as one [K, dim] table per shard;
* `loop`: the same work a client at a time (executor=loop: core/executors.py LoopExecutor, each client's gradient
  by plain autograd, problem.loop_grad), as the peers' per-client loops do, with the same slots.

Both engines are built once in this process from the same settings and stepped alternately, round by round, so
load from other work hits them alike; the first `--warmup` rounds of each are not timed. Reported: the median ms a
round of each, their ratio, and the personal slots' memory (ClientStore.nbytes: the rows the store holds, 4 bytes
a parameter, one row per client that has trained) after the timed rounds. Writes benchmarks/out/personal.json.

    python benchmarks/bench_personal.py [--rounds 30 --warmup 3 --steps 5]
"""

from __future__ import annotations

import argparse
import time
from statistics import median

import torch

from outputs import publish


def engines(args):
    from fedharness.assembly.build import algorithm_for
    from fedharness.config.load import load_settings
    from fedharness.core.engine import Engine
    from fedharness.core.executors import InlineExecutor, LoopExecutor
    from fedharness.runs.execute import prepare

    cfg = load_settings(["dataset=digits", "dataset.num_clients=100", "partition=iid", "model=2nn", "algorithm=ditto",
                         "algorithm.clients_per_round=10", "algorithm.sampler=scheme_ii",
                         f"algorithm.local_steps={args.steps}", "reference=off", "progress=false", "threads=1"])
    problem = prepare(cfg)[0]
    made = {}
    for name, executor in (("batched", InlineExecutor), ("loop", LoopExecutor)):
        algorithm = algorithm_for(cfg, problem)
        made[name] = Engine(problem, algorithm, executor(problem, algorithm.solver), rounds=args.rounds + args.warmup,
                            seed=cfg.seed, replicas=1, eval_every=10 ** 6)
    return problem, made


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    problem, made = engines(args)
    states = {name: engine.initial_state() for name, engine in made.items()}
    times: dict[str, list[float]] = {name: [] for name in made}
    for rnd in range(args.rounds + args.warmup):
        for name, engine in made.items():
            start = time.perf_counter()
            states[name] = engine.step(states[name])
            if rnd >= args.warmup:
                times[name].append(1e3 * (time.perf_counter() - start))
    gap = (states["batched"].x - states["loop"].x).abs().max().item()
    stores = {name: sum(s.store.nbytes for s in engine.executor.shards) for name, engine in made.items()}
    holders = len(made["batched"].executor.get_state())
    ms = {name: median(values) for name, values in times.items()}
    record = {"dim": problem.dim, "clients_per_round": 10, "local_steps": args.steps, "rounds_timed": args.rounds,
              "ms_per_round": ms, "loop_over_batched": ms["loop"] / ms["batched"], "slot_bytes": stores,
              "clients_with_slots": holders, "slot_bytes_per_client": stores["batched"] / holders,
              "max_abs_gap_of_models": gap}
    lines = [f"Ditto round, K = 10, 2NN ({problem.dim:,} params), E = {args.steps}, median of {args.rounds} rounds:",
             f"  batched {ms['batched']:.1f} ms   loop {ms['loop']:.1f} ms   loop / batched {ms['loop'] / ms['batched']:.2f}x",
             f"  personal slots: {stores['batched']:,} bytes for {holders} clients ({stores['batched'] // holders:,} "
             f"a client); loop's {stores['loop']:,}",
             f"  largest |x_batched - x_loop| after the rounds: {gap:.2e} (float32 rounding of other kernels)"]
    publish(record, lines, "personal")


if __name__ == "__main__":
    main()
