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

`--finetune` (eval.personal's finetune, core/personal.py): fine-tune-then-evaluate on every client of 1,000
digits clients (iid) with the 2NN, 1 replica, `--steps` plain SGD steps of batch 10 from the same global model:

* `batched`: the product's path, a shard's client_scores with a FineTune spec (every client one copy of a batched
  step, then each copy scored on its own held-out data);
* `loop`: the same work a client at a time, as the peers do: the same minibatches (the same FINETUNE streams),
  each client's gradient by plain autograd (problem.loop_grad), then its score.

Both in this process, paired and interleaved (median of `--repeats`); the peak resident memory of each in a fresh
child process (ru_maxrss after the case, less after building the problem). Writes benchmarks/out/finetune_eval.json.

    python benchmarks/bench_client_eval.py [--repeats 5] [--models logreg,2nn,bn_mlp]
    python benchmarks/bench_client_eval.py --finetune [--repeats 5] [--clients 1000] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
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


def finetune_setup(clients: int, steps: int):
    """The digits problem of `clients` clients with the 2NN, its shard, the global model and the FineTune spec."""
    from fedharness.algorithms.solvers import LocalSGD
    from fedharness.config.load import load_settings
    from fedharness.core.executors import ClientShard
    from fedharness.core.personal import FineTune
    from fedharness.problems import build_problem

    settings = load_settings(["dataset=digits", f"dataset.num_clients={clients}", "partition=iid", "model=2nn",
                              "algorithm.batch_size=10", "algorithm.client_lr=0.05", "eval.personal=[finetune]",
                              f"eval.finetune_steps={steps}", "memory_budget_gb=null", "progress=false"])
    problem = build_problem(settings, 10)
    shard = ClientShard(problem, LocalSGD(), (0, problem.num_clients))  # its solver only sizes the batches
    x = problem.init_params(1, 0)
    every = np.arange(problem.num_clients)
    spec = FineTune(steps, np.array([0.05]), 1, np.array([0]), np.array([0]), every)
    return problem, shard, x, every, spec


def finetune_loop(problem, x: torch.Tensor, clients: np.ndarray, spec) -> None:
    """Fine-tune-then-evaluate a client at a time: the batched path's minibatches, plain autograd gradients."""
    from fedharness.contracts import ClientKeys
    from fedharness.core.personal import finetune_seeds

    seed = int(finetune_seeds(spec.seeds[0]))
    for k in clients:
        keys = ClientKeys(np.array([k]), spec.stream_replicas[:1], spec.round, seed)
        batches = problem.round_batches(keys, spec.steps)
        w = x.clone()
        for t in range(spec.steps):
            w = w - float(spec.lrs[0]) * problem.loop_grad(w, batches, t)
        problem.copy_scores(w.detach(), np.array([k]))


def finetune_cases(clients: int, steps: int) -> dict:
    problem, shard, x, every, spec = finetune_setup(clients, steps)
    return {"batched": lambda: shard.client_scores(x, np.array([0]), every, spec),
            "loop": lambda: finetune_loop(problem, x, every, spec)}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def finetune_peak(case: str, clients: int, steps: int) -> dict:
    """A child's resident memory running one case once: before it (the problem built, the case run once to warm
    up) and its peak during the run, sampled every millisecond (ru_maxrss would hold the problem's build)."""
    import threading

    fn = finetune_cases(clients, steps)[case]
    fn()
    before, peak, done = _rss_mb(), [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_mb())
            time.sleep(1e-3)

    watcher = threading.Thread(target=watch)
    watcher.start()
    fn()
    done.set()
    watcher.join()
    return {"peak_mb": max(peak[0], _rss_mb()), "before_mb": before}


def finetune_main(args) -> None:
    from children import run_child

    cases = finetune_cases(args.clients, args.steps)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    ms = {name: median(t) for name, t in times.items()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peaks = {name: run_child(__file__, "peak", {"case": name, "clients": args.clients, "steps": args.steps}, env)
             for name in cases}
    record = {"clients": args.clients, "steps": args.steps, "model": "2nn", "ms": ms, "ms_all": times,
              "peak_mb": peaks}
    lines = [f"fine-tune-then-evaluate, {args.clients} digits clients, 2NN, {args.steps} steps, 1 thread",
             f"{'case':8} {'median ms':>10} {'RSS before MB':>14} {'peak MB':>8} {'peak - before':>14}"]
    for name in cases:
        p = peaks[name]
        lines.append(f"{name:8} {ms[name]:10.1f} {p['before_mb']:14.0f} {p['peak_mb']:8.0f} "
                     f"{p['peak_mb'] - p['before_mb']:14.0f}")
    lines.append(f"loop / batched: {ms['loop'] / ms['batched']:.1f}x; load average at end: {os.getloadavg()[0]:.2f}")
    publish(record, lines, "finetune_eval")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--finetune", action="store_true")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        payload = json.loads(args.child[1])
        print(json.dumps(finetune_peak(payload["case"], payload["clients"], payload["steps"])))
        return
    if args.finetune:
        finetune_main(args)
        return
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
