"""Per-client evaluation (eval.per_client) at FEMNIST's client count: 3,550 clients, each on its own held-out data.

Synthetic(1,1) with 3,550 clients of 250 samples (225 train, 25 held out each: 88,750 held-out samples), logistic
regression, the 2NN (two hidden layers of 200) and, for FedBN (model.buffers=local), an MLP with BatchNorm
(60-200-BatchNorm-200-10) whose every client has its own buffers; R = 1 and R = 4 replicas, 1 torch thread. Per case, paired and
interleaved repeat by repeat so load from other work hits them alike (median of `--repeats`):

* `vectorized`: problem.client_scores over all 3,550 clients (one pass over the held-out samples, sums scattered
  by client, every replica at once);
  FedBN: each replica's parameters with every client's own buffers, the buffer sets under vmap, on the clients'
  samples padded to the longest of a batch);
* `loop`: the same scores a client at a time through the model's loss_terms (what the vectorized pass replaces);
* `pooled`: one pass over the pooled test set (test_loss and test_acc), the evaluation every run already does.

Prints a table and writes benchmarks/out/client_eval.json.

    python benchmarks/bench_client_eval.py [--repeats 5] [--models logreg,2nn,bn_mlp]
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
MODELS = {"logreg": [], "2nn": [], "bn_mlp": ["model.buffers=local"]}  # bn_mlp: FedBN, every client its own buffers


def bn_mlp(in_shape, num_classes):
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(in_shape)), 200), nn.BatchNorm1d(200), nn.ReLU(),
                         nn.Linear(200, num_classes))


def build(model: str):
    import fedharness
    from fedharness.config.load import load_settings
    from fedharness.problems import build_problem

    fedharness.register_model("bn_mlp", bn_mlp)
    settings = load_settings(["dataset=synthetic", f"dataset.num_clients={CLIENTS}",
                              f"dataset.samples_per_client={SAMPLES}", f"model={model}", *MODELS[model],
                              "eval.per_client=true", "progress=false"])
    return build_problem(settings, 10)


def own_buffers(problem, w: torch.Tensor) -> dict | None:
    """FedBN: every (replica, client) its own running statistics (the server's, scaled per client)."""
    b = problem.objective.buffer_dim
    if not b:
        return None
    return {(r, k): w[r, -b:] * (1 + k / CLIENTS) for r in range(len(w)) for k in range(CLIENTS)}


def loop(problem, w: torch.Tensor, clients: np.ndarray, buffers: dict | None) -> None:
    b = problem.objective.buffer_dim
    with torch.no_grad():
        for k in clients:
            wk = w
            if buffers:
                wk = w.clone()
                for r in range(len(w)):
                    wk[r, -b:] = buffers[(r, int(k))]
            rows = torch.as_tensor(problem.client_test[k])
            problem.objective.loss_terms(wk, problem.x_test.index_select(0, rows), problem.y_test.index_select(0, rows))


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    record: dict = {"clients": CLIENTS, "held_out_per_client": SAMPLES - int(0.9 * SAMPLES), "cases": []}
    lines = [f"{'model':8} {'R':>2} {'vectorized ms':>14} {'loop ms':>9} {'pooled ms':>10} {'loop/vec':>9} "
             f"{'vec/pooled':>11}"]
    clients = np.arange(CLIENTS)
    for model in args.models.split(","):
        problem = build(model)
        for replicas in (1, 4):
            w = problem.init_params(replicas, 0) + 0.01 * torch.randn(replicas, problem.dim)
            buffers = own_buffers(problem, w)
            cases = {"vectorized": lambda: problem.client_scores(w, clients, buffers),
                     "loop": lambda: loop(problem, w, clients, buffers),
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
