"""Per-client evaluation (eval.per_client) at FEMNIST's client count: 3,550 clients, each on its own held-out data.

Synthetic(1,1) with 3,550 clients of 250 samples (225 train, 25 held out each: 88,750 held-out samples), logistic
regression and the 2NN (two hidden layers of 200), R = 1 and R = 4 replicas, 1 torch thread. Per case, paired and
interleaved repeat by repeat so load from other work hits them alike (median of `--repeats`):

* `vectorized`: problem.client_scores over all 3,550 clients (one pass over the held-out samples, sums scattered
  by client, every replica at once);
* `loop`: the same scores a client at a time through the model's loss_terms (what the vectorized pass replaces);
* `pooled`: one pass over the pooled test set (test_loss and test_acc), the evaluation every run already does.

Prints a table and writes benchmarks/out/client_eval.json.

    python benchmarks/bench_client_eval.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import time
from statistics import median

import numpy as np
import torch

from outputs import publish

CLIENTS, SAMPLES = 3550, 250


def build(model: str):
    from fedharness.config.load import load_settings
    from fedharness.problems import build_problem

    settings = load_settings(["dataset=synthetic", f"dataset.num_clients={CLIENTS}",
                              f"dataset.samples_per_client={SAMPLES}", f"model={model}", "eval.per_client=true",
                              "progress=false"])
    return build_problem(settings, 10)


def loop(problem, w: torch.Tensor, clients: np.ndarray) -> None:
    with torch.no_grad():
        for k in clients:
            rows = torch.as_tensor(problem.client_test[k])
            problem.objective.loss_terms(w, problem.x_test.index_select(0, rows), problem.y_test.index_select(0, rows))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    record: dict = {"clients": CLIENTS, "held_out_per_client": SAMPLES - int(0.9 * SAMPLES), "cases": []}
    lines = [f"{'model':8} {'R':>2} {'vectorized ms':>14} {'loop ms':>9} {'pooled ms':>10} {'loop/vec':>9} "
             f"{'vec/pooled':>11}"]
    clients = np.arange(CLIENTS)
    for model in ("logreg", "2nn"):
        problem = build(model)
        for replicas in (1, 4):
            w = problem.init_params(replicas, 0) + 0.01 * torch.randn(replicas, problem.dim)
            cases = {"vectorized": lambda: problem.client_scores(w, clients),
                     "loop": lambda: loop(problem, w, clients),
                     "pooled": lambda: problem._mean_loss(w, problem.x_test, problem.y_test)}
            times: dict[str, list[float]] = {name: [] for name in cases}
            for name, fn in cases.items():  # warm-up
                fn()
            for _ in range(args.repeats):
                for name, fn in cases.items():
                    times[name].append(timed(fn))
            ms = {name: median(t) for name, t in times.items()}
            record["cases"].append({"model": model, "replicas": replicas, "ms": ms, "ms_all": times})
            lines.append(f"{model:8} {replicas:>2} {ms['vectorized']:14.1f} {ms['loop']:9.1f} {ms['pooled']:10.1f} "
                         f"{ms['loop'] / ms['vectorized']:9.1f} {ms['vectorized'] / ms['pooled']:11.2f}")
    lines.append(f"load average at end: {os.getloadavg()[0]:.2f}")
    publish(record, lines, "client_eval")


if __name__ == "__main__":
    main()
