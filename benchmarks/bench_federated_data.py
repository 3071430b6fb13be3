"""Federated data at LEAF's scale: set-up time (first load and cached), peak memory and ms/round of dataset=leaf.

Writes two LEAF folders as LEAF's preprocess.sh leaves them (train/ and test/ of JSON, 90/10 per client, sample
sizes with LEAF's skew: lognormal with LEAF's reported mean and standard deviation):

* FEMNIST-shaped: 3,550 writers, 226.8 +- 88.9 images each (805k in all), 28 x 28 pixels k/255 written as LEAF
  writes them (80% white background, as handwriting on paper), 62 classes;
* Shakespeare-shaped: 1,129 roles, 3,743 +- 6,212 samples each (4.2M characters in all), each an 80-letter window
  of the role's text and the next letter, in LEAF's 80-letter vocabulary.

Then loads each as a user would (`dataset=leaf dataset.path=DIR`, partition natural) in a fresh process: the
first load (parsing the JSON, writing the per-client cache) and a second one (memory-mapping the cache), each
with its set-up seconds (the problem built) and peak resident memory; and ms/round (median) of FedAvg at K=10
(scheme I), 1 local epoch-free step count of 10 steps of b=20, with model=logreg (the data path) and with the
FEMNIST CNN / char LSTM where this checkout registers them (femnist_cnn, char_lstm). `--writers` and `--roles`
scale the two data sets down for a short run. Prints a table and writes benchmarks/out/federated_data.json.

    python benchmarks/bench_federated_data.py [--writers 3550] [--roles 1129] [--rounds 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np

from children import run_child
from outputs import publish

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# LEAF's paper, Table 1: users, samples per user (mean, stdev)
FEMNIST = {"clients": 3550, "mean": 226.83, "std": 88.94}
SHAKESPEARE = {"clients": 1129, "mean": 3743.28, "std": 6212.26}
PER_FILE = 100  # clients per JSON file
MODELS = {"femnist": "femnist_cnn", "shakespeare": "char_lstm"}
WARMUP = 1


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the parent that forked)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def skewed_sizes(rng: np.random.Generator, shape: dict, clients: int) -> np.ndarray:
    """Sample counts per client: lognormal with LEAF's coefficient of variation, scaled to LEAF's mean (so the
    total is LEAF's: the heavy tail of one draw would otherwise miss it), at least 2 (train and test)."""
    sigma2 = np.log1p((shape["std"] / shape["mean"]) ** 2)
    draw = rng.lognormal(-sigma2 / 2, np.sqrt(sigma2), clients)
    return np.maximum(2, np.rint(draw * shape["mean"] * clients / draw.sum())).astype(np.int64)


def _write(folder: Path, split: str, index: int, users: list[str], xs: list[str], ys: list[str],
           counts: list[int]) -> int:
    """One LEAF JSON file; `xs` and `ys` are each user's samples already as JSON text. Returns its bytes."""
    data = ", ".join(f'"{u}": {{"x": {x}, "y": {y}}}' for u, x, y in zip(users, xs, ys))
    text = (f'{{"users": {json.dumps(users)}, "num_samples": {json.dumps(counts)}, '
            f'"user_data": {{{data}}}}}')
    path = folder / split / f"all_data_{index}_niid_0_keep_0_{split}_9.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return len(text)


def write_femnist(folder: Path, writers: int, seed: int = 0) -> dict:
    """The FEMNIST-shaped folder; returns its sizes."""
    rng = np.random.default_rng(seed)
    sizes = skewed_sizes(rng, FEMNIST, writers)
    pixel = np.array([repr(k / 255) for k in range(256)], dtype=object)  # LEAF: vec / 255, then tolist()
    total = 0
    for start in range(0, writers, PER_FILE):
        users = [f"f{w:04d}_{w % 100:02d}" for w in range(start, min(start + PER_FILE, writers))]
        parts: dict[str, tuple[list, list, list]] = {"train": ([], [], []), "test": ([], [], [])}
        for u, n in zip(users, sizes[start:start + PER_FILE]):
            codes = np.where(rng.random((n, 784)) < 0.8, 255, rng.integers(0, 255, (n, 784)))
            labels = rng.integers(0, 62, n)
            rows = ["[" + ",".join(pixel[row]) + "]" for row in codes]
            cut = max(1, int(0.9 * n))
            for split, sl in (("train", slice(0, cut)), ("test", slice(cut, n))):
                parts[split][0].append("[" + ",".join(rows[sl]) + "]")
                parts[split][1].append(json.dumps(labels[sl].tolist()))
                parts[split][2].append(len(labels[sl]))
        for split, (xs, ys, counts) in parts.items():
            total += _write(folder, split, start // PER_FILE, users, xs, ys, counts)
    return {"clients": writers, "samples": int(sizes.sum()), "json_bytes": total}


def write_shakespeare(folder: Path, roles: int, seed: int = 1) -> dict:
    """The Shakespeare-shaped folder; returns its sizes."""
    from fedharness.problems.leaf import LETTERS

    rng = np.random.default_rng(seed)
    sizes = skewed_sizes(rng, SHAKESPEARE, roles)
    letters = np.frombuffer(LETTERS.encode(), dtype=np.uint8)
    total = 0
    for start in range(0, roles, PER_FILE):
        users = [f"THE_PLAY_{r:04d}" for r in range(start, min(start + PER_FILE, roles))]
        parts: dict[str, tuple[list, list, list]] = {"train": ([], [], []), "test": ([], [], [])}
        for u, n in zip(users, sizes[start:start + PER_FILE]):
            text = letters[rng.integers(0, len(letters), n + 80)].tobytes().decode()
            windows = [text[i:i + 80] for i in range(n)]
            nexts = [text[i + 80] for i in range(n)]
            cut = max(1, int(0.9 * n))
            for split, sl in (("train", slice(0, cut)), ("test", slice(cut, n))):
                parts[split][0].append(json.dumps(windows[sl]))
                parts[split][1].append(json.dumps(nexts[sl]))
                parts[split][2].append(len(nexts[sl]))
        for split, (xs, ys, counts) in parts.items():
            total += _write(folder, split, start // PER_FILE, users, xs, ys, counts)
    return {"clients": roles, "samples": int(sizes.sum()), "json_bytes": total}


def load_child(path: str, cache: str, model: str, rounds: int) -> dict:
    """Load the folder as a user would and time the problem's set-up; then `rounds` rounds of FedAvg at K=10."""
    import torch

    torch.set_num_threads(1)
    from fedharness.assembly.build import build_parts
    from fedharness.config.load import load_settings
    from fedharness.core.executors import InlineExecutor
    from fedharness.registry.groups import MODELS

    before = peak_rss_mb()
    settings = load_settings(["dataset=leaf", f"dataset.path={path}", f"dataset.cache_dir={cache}",
                              "algorithm.sampler=scheme_i", "algorithm.clients_per_round=10",
                              "algorithm.local_steps=10", "algorithm.batch_size=20", "reference=off",
                              "heterogeneity=false", "progress=false", f"model={model}" if model in MODELS
                              else "model=logreg", "memory_budget_gb=1"])
    start = time.perf_counter()
    problem, algorithm = build_parts(settings)
    setup_s = time.perf_counter() - start
    out = {"setup_s": setup_s, "peak_mb": peak_rss_mb(), "imports_mb": before, "clients": problem.num_clients,
           "train_samples": int(problem.sizes.sum()), "stored_mb": problem.x.element_size() * problem.x.numel() / 2**20,
           "ms_per_round": None, "model": model if model in MODELS else None}
    if rounds and model in MODELS:
        from fedharness.algorithms.series import build_series
        from fedharness.runs.execute import Prepared, build_engine

        engine = build_engine(Prepared(settings, problem, algorithm, None, *build_series(1)),
                              InlineExecutor(problem, algorithm.solver, 1))
        state, times = engine.initial_state(), []
        for r in range(WARMUP + rounds):
            t = time.perf_counter()
            state = engine.step(state)
            if r >= WARMUP:
                times.append(time.perf_counter() - t)
        out["ms_per_round"] = 1000 * median(times)
    out["peak_after_rounds_mb"] = peak_rss_mb()
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        p = json.loads(sys.argv[3])
        print(json.dumps(load_child(p["path"], p["cache"], p["model"], p["rounds"])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=FEMNIST["clients"], help="FEMNIST-shaped writers")
    parser.add_argument("--roles", type=int, default=SHAKESPEARE["clients"], help="Shakespeare-shaped roles")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds a model")
    parser.add_argument("--dir", default=None, help="where the folders go (default: a temporary folder, removed)")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fedharness-bench-"))
    record: dict = {"host": platform.node(), "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
                    "data": {}, "loads": {}}
    lines = [f"dataset=leaf on {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f} at start; "
             f"FedAvg K=10 (scheme I), 10 steps of b=20, 1 thread; {args.rounds} timed rounds",
             f"  {'data set':<12}{'clients':>8}{'samples':>10}{'JSON MB':>9}{'write s':>8} | {'load':<7}"
             f"{'set-up s':>9}{'peak MB':>9}{'imports':>8}{'stored MB':>10} | {'model':<12}{'ms/round':>9}"]
    try:
        for name, write, count in (("femnist", write_femnist, args.writers),
                                   ("shakespeare", write_shakespeare, args.roles)):
            folder, cache = root / name, root / f"{name}-cache"
            t = time.perf_counter()
            info = write(folder, count)
            info["write_s"] = time.perf_counter() - t
            record["data"][name] = info
            for load in ("first", "cached", "logreg"):
                model = "logreg" if load == "logreg" else MODELS[name]
                m = run_child(__file__, "load", {"path": str(folder), "cache": str(cache), "model": model,
                                                 "rounds": args.rounds if load != "first" else 0}, CHILD_ENV)
                record["loads"][f"{name}/{load}"] = m
                head = (f"  {name:<12}{info['clients']:>8,}{info['samples']:>10,}{info['json_bytes'] / 1e6:>9.0f}"
                        f"{info['write_s']:>8.0f}") if load == "first" else " " * 47
                ms = "-" if m["ms_per_round"] is None else f"{m['ms_per_round']:.1f}"
                shown = m["model"] or f"{model} (absent)"
                lines.append(f"{head} | {load if load != 'logreg' else 'cached':<7}{m['setup_s']:>9.2f}"
                             f"{m['peak_mb']:>9.0f}{m['imports_mb']:>8.0f}{m['stored_mb']:>10.0f} | "
                             f"{shown if load != 'first' else '':<12}"
                             f"{ms if load != 'first' else '':>9}")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    lines.append("  set-up: the problem built (first: JSON parsed and the per-client cache written; cached: the "
                 "cache memory-mapped); peak: the process's peak resident memory (imports: after importing torch "
                 "and fedharness); stored: the training samples as kept")
    publish(record, lines, "federated_data")


if __name__ == "__main__":
    main()
