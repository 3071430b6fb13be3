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
FEMNIST CNN / char LSTM where this checkout registers them (femnist_cnn, char_lstm), and ms per evaluation: one
evaluation of the run (engine.evaluate with the default eval.* keys) after those rounds, with its train_loss and
train_loss_se. A load that runs past `--eval-timeout` is stopped and reported with its evaluation unfinished.
`--writers` and `--roles` scale the two data sets down for a short run; `--only` and `--loads` pick one data set
and some of the loads; `--dir` keeps the folders, and a later run reuses them. Prints a table and writes
benchmarks/out/NAME.json (`--name`, default federated_data).

    python benchmarks/bench_federated_data.py [--writers 3550] [--roles 1129] [--rounds 5] [--evals 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np

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


def load_child(path: str, cache: str, model: str, rounds: int, evals: int, warmup: int = WARMUP) -> dict:
    """Load the folder as a user would and time the problem's set-up; then `rounds` rounds of FedAvg at K=10 and
    `evals` of the run's evaluations (engine.evaluate with the default eval.* keys, as eval_every triggers it).
    The rounds' figures are printed (a JSON line) before the evaluations start, so a parent that stops an
    evaluation running past its time limit still has them."""
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
    out["peak_after_rounds_mb"] = out["peak_mb"]
    print(json.dumps(out), flush=True)
    if rounds and model in MODELS:
        from fedharness.algorithms.series import build_series
        from fedharness.runs.execute import Prepared, build_engine

        engine = build_engine(Prepared(settings, problem, algorithm, None, *build_series(1)),
                              InlineExecutor(problem, algorithm.solver, 1))
        state, times = engine.initial_state(), []
        for r in range(warmup + rounds):
            t = time.perf_counter()
            state = engine.step(state)
            if r >= warmup:  # each round's figures printed as they come (a parent that stops the child has them)
                times.append(time.perf_counter() - t)
                out.update(ms_per_round=1000 * median(times), rounds_timed=len(times),
                           peak_after_rounds_mb=peak_rss_mb())
                print(json.dumps(out), flush=True)
        eval_times, read, inner = [], {"rows": 0, "start": time.perf_counter()}, problem._model_input

        def counted(x):  # samples the evaluation has read so far: a stopped evaluation's progress
            read["rows"] += len(x)
            out.update(eval_rows_read=read["rows"], eval_s_so_far=time.perf_counter() - read["start"])
            print(json.dumps(out), flush=True)
            return inner(x)

        problem._model_input = counted
        for _ in range(evals):
            t = time.perf_counter()
            row = engine.evaluate(state)[0]
            eval_times.append(time.perf_counter() - t)
        if eval_times:
            out.update(ms_per_eval=1000 * median(eval_times), train_loss=row["train_loss"],
                       train_loss_se=row.get("train_loss_se"), test_loss=row.get("test_loss"),
                       grad_norm_sq=row.get("grad_norm_sq"))
    out["peak_after_rounds_mb"] = peak_rss_mb()
    return out


def _child_peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def run_load(payload: dict, timeout_s: float) -> dict:
    """load_child in a fresh process; one stopped after `timeout_s` (an evaluation over all the data can take
    hours) gives the figures it printed before, with its evaluation marked unfinished."""
    cmd = [sys.executable, __file__, "--child", "load", json.dumps(payload)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CHILD_ENV) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            peak = _child_peak_mb(proc.pid)  # its peak so far, evaluation included, read before it is stopped
            proc.kill()
            stdout, stderr = proc.communicate()
            lines = stdout.strip().splitlines()
            if not lines:
                raise RuntimeError(f"benchmark child {payload} printed nothing in {timeout_s:.0f} s") from None
            return {**json.loads(lines[-1]), "eval_unfinished_after_s": timeout_s, "peak_after_rounds_mb": peak}
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {payload} failed:\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        p = json.loads(sys.argv[3])
        print(json.dumps(load_child(p["path"], p["cache"], p["model"], p["rounds"], p["evals"],
                                    p.get("warmup", WARMUP))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=FEMNIST["clients"], help="FEMNIST-shaped writers")
    parser.add_argument("--roles", type=int, default=SHAKESPEARE["clients"], help="Shakespeare-shaped roles")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds a model (after one untimed)")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed rounds before the timed ones")
    parser.add_argument("--loads", default="first,cached,logreg",
                        help="which loads: first (parse and cache), cached (the paper's model), logreg (cached)")
    parser.add_argument("--evals", type=int, default=1, help="timed evaluations of each model, after its rounds")
    parser.add_argument("--eval-timeout", type=float, default=1800,
                        help="seconds a load (set-up, rounds, evaluations) may take; past it, the evaluation is "
                             "reported unfinished")
    parser.add_argument("--name", default="federated_data", help="the record's name: benchmarks/out/NAME.json")
    parser.add_argument("--only", choices=("femnist", "shakespeare"), default=None, help="one data set only")
    parser.add_argument("--dir", default=None, help="where the folders go (default: a temporary folder, removed); "
                                                    "a folder written there before is reused")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fedharness-bench-"))
    record: dict = {"host": platform.node(), "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
                    "data": {}, "loads": {}}
    lines = [f"dataset=leaf on {os.cpu_count()} CPU(s), load average {os.getloadavg()[0]:.1f} at start; "
             f"FedAvg K=10 (scheme I), 10 steps of b=20, 1 thread; {args.rounds} timed rounds, "
             f"{args.evals} timed evaluation(s)",
             f"  {'data set':<12}{'clients':>8}{'samples':>10}{'JSON MB':>9}{'write s':>8} | {'load':<7}"
             f"{'set-up s':>9}{'peak MB':>9}{'imports':>8}{'stored MB':>10} | {'model':<12}{'ms/round':>9}"
             f"{'ms/eval':>10}{'train_loss':>11}{'se':>9}"]
    try:
        for name, write, count in (("femnist", write_femnist, args.writers),
                                   ("shakespeare", write_shakespeare, args.roles)):
            if args.only not in (None, name):
                continue
            folder, cache = root / name, root / f"{name}-cache"
            info_file = root / f"{name}.json"
            if info_file.is_file():  # written by an earlier run into --dir: the same data
                info = json.loads(info_file.read_text())
            else:
                t = time.perf_counter()
                info = write(folder, count)
                info["write_s"] = time.perf_counter() - t
                info_file.write_text(json.dumps(info))
            record["data"][name] = info
            for load in args.loads.split(","):
                if load == "logreg" and name == "shakespeare":
                    continue  # logistic regression on token ids is refused (model=auto's check): images only
                model = "logreg" if load == "logreg" else MODELS[name]
                timed = load != "first"
                m = run_load({"path": str(folder), "cache": str(cache), "model": model,
                              "rounds": args.rounds if timed else 0, "evals": args.evals if timed else 0,
                              "warmup": args.warmup},
                             args.eval_timeout)
                m["loadavg_after"] = os.getloadavg()
                record["loads"][f"{name}/{load}"] = m
                head = (f"  {name:<12}{info['clients']:>8,}{info['samples']:>10,}{info['json_bytes'] / 1e6:>9.0f}"
                        f"{info['write_s']:>8.0f}") if load == "first" else " " * 47
                ms = "-" if m["ms_per_round"] is None else f"{m['ms_per_round']:.1f}"
                ev = (f"> {m['eval_unfinished_after_s']:.0f} s" if "eval_unfinished_after_s" in m else
                      "-" if m.get("ms_per_eval") is None else f"{m['ms_per_eval']:.0f}")
                loss = "-" if m.get("train_loss") is None else f"{m['train_loss']:.4f}"
                se = "-" if m.get("train_loss_se") is None else f"{m['train_loss_se']:.4f}"
                shown = m["model"] or f"{model} (absent)"
                lines.append(f"{head} | {load if load != 'logreg' else 'cached':<7}{m['setup_s']:>9.2f}"
                             f"{m['peak_after_rounds_mb']:>9.0f}{m['imports_mb']:>8.0f}{m['stored_mb']:>10.0f} | "
                             f"{shown if timed else '':<12}{ms if timed else '':>9}{ev if timed else '':>10}"
                             f"{loss if timed else '':>11}{se if timed else '':>9}")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    lines.append("  set-up: the problem built (first: JSON parsed and the per-client cache written; cached: the "
                 "cache memory-mapped); peak: the process's peak resident memory, rounds and evaluations included "
                 "(imports: after importing torch and fedharness); stored: the training samples as kept; ms/eval: "
                 "one evaluation of the run (engine.evaluate, default eval.* keys), after the rounds")
    publish(record, lines, args.name)


if __name__ == "__main__":
    main()
