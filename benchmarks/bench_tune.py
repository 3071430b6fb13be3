"""Tuning at scale (issue 18): a 64-trial study run one trial at a time against `tune.batch=16` and `tune.batch=64`
(trials trained as batched runs, harness/studies/tuning/batched_trials.py), on W1 (benchmarks/run.py) and on the smoke-size
CNN (benchmarks/models.py), all in one process so the ratios compare like with like.

Each study: client_lr (log-uniform 1e-3..1) x local steps E (1..E_max, log), a budget of local steps (a trial with
larger E runs fewer rounds), objective final train_loss, sampler=random with seed 0, so every mode proposes the same
64 trials; the benchmark reports wall time, trials per minute, the speed-up over the sequential study, and whether
every mode finds the same best trial (number and parameters). Writes benchmarks/out/tune.json.

    python benchmarks/bench_tune.py [--trials 64] [--batches 16,64] [--threads 1] [--skip-cnn]
    python benchmarks/bench_tune.py --sections startup [--startup-reps 7]   # only the start-up ratio
    python benchmarks/bench_tune.py --sections quality [--seeds 10]         # search quality, batched vs sequential
    python benchmarks/bench_tune.py --sections speed [--speed-trials 1000]  # a long study, sequential vs batch=64
    python benchmarks/bench_tune.py --sections hyperband [--hyperband-seeds 3]  # Hyperband vs full-budget trials
    python benchmarks/bench_tune.py --sections process [--process-pairs 5]  # as a user runs it: whole processes

Quality (issue 26): over study seeds 0..seeds-1, 64-trial studies of sequential TPE, TPE with tune.batch=16,
CMA-ES with tune.batch=16 (popsize 16) and TPE with batch-native Hyperband (tune.pruner.name=hyperband, batch 16),
each workload; the median, the quartiles and the range of the best value (--modes picks some).
Speed: a `--speed-trials` study with tune.batch=64 against the sequential study (random sampler, so both run the same
trials); `--speed-sequential-trials N` runs the sequential one on N trials only and extrapolates its rate.

Process (issue 54): the 64-trial W1 study as `fedharness tune` runs it, each study a whole process of its own (its
imports, composition, storage and exit included), sequential and tune.batch=64 in turn after one warm-up pair; the
medians of the wall and CPU seconds and of the pairs' ratios.

Sections are functions `section_*(args) -> dict` listed in SECTIONS; each returns its record and prints its lines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import optuna
import torch

import fedharness
from fedharness.runs.lifecycle import open_results
from fedharness.studies.tuning.budget import forget_replays
from fedharness.studies.tuning.spec import build_spec
from fedharness.studies.tuning.study import tune

from models import SMOKE, noise_images
from run import W1

# The study: tune config `default` (client_lr x local_steps), random sampler, no plots; trials run with 1 thread.
STUDY = ["tune=default", "tune.sampler.name=random", "tune.sampler.seed=0", "tune.plots=false", "threads=1"]
WORKLOADS = {
    # W1 with its E = 20 in the middle of the space: 400 local steps, so E = 20 runs 20 rounds and E = 1 400
    "W1": {"run": W1, "tune": ["tune.budget.total=400", "tune.space.local_steps.high=50"]},
    # the smoke CNN (10 clients, 5 per round, b = 8): 40 local steps, E up to 8
    "CNN smoke": {"run": [*SMOKE, "model=cnn"], "tune": ["tune.budget.total=40", "tune.space.local_steps.high=8"]},
}


def run_study(workload: dict, trials: int, batch: int, results: Path, extra: tuple[str, ...] = ()) -> dict:
    """One study in a fresh results folder: wall seconds, trials per minute and its best trial. `extra`: tune.*
    overrides after the benchmark's (another sampler, seed)."""
    forget_replays()  # each study (its probe, then its trials) pays its own budget replays, as in a process of its own
    spec = build_spec([*STUDY, *workload["tune"], f"tune.n_trials={trials}", f"tune.batch={batch}", *extra,
                       f"results_dir={results}", *workload["run"]])
    start, cpu = time.perf_counter(), time.process_time()
    tune(spec, open_results(spec.results_dir), echo=lambda line: None)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # CPU: steadier on a shared machine
    study = optuna.load_study(study_name=spec.study, storage=spec.storage)
    best = study.best_trial
    spent = sum(int(t.user_attrs.get("budget_used") or 0) for t in study.get_trials())  # pruned trials' too
    return {"batch": batch, "seconds": seconds, "cpu_seconds": cpu, "trials_per_min": 60 * trials / seconds,
            "best_trial": best.number, "best_params": best.params, "best_value": best.value, "steps_spent": spent}


def section_batched_studies(args) -> dict:
    """Sequential vs tune.batch=B on each workload; ratios within this run."""
    record = {}
    names = [n for n in WORKLOADS if not (args.skip_cnn and n.startswith("CNN"))]
    for name in names:
        rows = []
        for batch in (1, *args.batches):
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(run_study(WORKLOADS[name], args.trials, batch, Path(tmp)))
        seq = rows[0]
        for row in rows:
            row["speedup"] = seq["seconds"] / row["seconds"]
            row["cpu_speedup"] = seq["cpu_seconds"] / row["cpu_seconds"]
            row["same_best"] = (row["best_trial"], row["best_params"]) == (seq["best_trial"], seq["best_params"])
        record[name] = rows
        print(f"\n{name}: {args.trials}-trial study over client_lr x E (sampler=random, seed 0), 1 thread")
        print(f"  {'mode':<16}{'wall s':>9}{'trials/min':>12}{'speed-up':>10}{'CPU s':>8}{'CPU ratio':>10}  "
              "best trial (same as sequential?)")
        for row in rows:
            mode = "sequential" if row["batch"] == 1 else f"tune.batch={row['batch']}"
            print(f"  {mode:<16}{row['seconds']:>9.1f}{row['trials_per_min']:>12.1f}{row['speedup']:>9.2f}x"
                  f"{row['cpu_seconds']:>8.1f}{row['cpu_speedup']:>9.2f}x  "
                  f"#{row['best_trial']} train_loss={row['best_value']:.6g} ({'yes' if row['same_best'] else 'NO'})")
    return record


QUALITY_MODES = {  # name -> (tune.batch, tune.* overrides)
    "sequential TPE": (1, ("tune.sampler.name=tpe",)),
    "TPE batch=16": (16, ("tune.sampler.name=tpe",)),
    "CMA-ES batch=16": (16, ("tune.sampler.name=cmaes",)),
    "TPE+Hyperband batch=16": (16, ("tune.sampler.name=tpe", "tune.pruner.name=hyperband")),
}


def _spread(values: list[float]) -> dict:
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": median, "q1": q1, "q3": q3, "min": min(values), "max": max(values), "n": len(values)}


def section_quality(args) -> dict:
    """Each mode's best value over study seeds 0..seeds-1 (64 trials by default): median, quartiles, range."""
    record = {}
    names = [n for n in WORKLOADS if not (args.skip_cnn and n.startswith("CNN"))]
    for name in names:
        bests = {mode: [] for mode in args.modes}
        for seed in range(args.seeds):
            for mode in args.modes:
                batch, extra = QUALITY_MODES[mode]
                with tempfile.TemporaryDirectory() as tmp:
                    row = run_study(WORKLOADS[name], args.trials, batch, Path(tmp),
                                    (*extra, f"tune.sampler.seed={seed}"))
                bests[mode].append(row["best_value"])
        record[name] = {mode: {**_spread(values), "values": values} for mode, values in bests.items()}
        print(f"\n{name}: best train_loss of a {args.trials}-trial study over {args.seeds} study seeds, 1 thread")
        print(f"  {'mode':<26}{'median':>10}{'q1':>10}{'q3':>10}{'min':>10}{'max':>10}")
        for mode, r in record[name].items():
            print(f"  {mode:<26}{r['median']:>10.5f}{r['q1']:>10.5f}{r['q3']:>10.5f}{r['min']:>10.5f}{r['max']:>10.5f}")
    return record


def section_speed(args) -> dict:
    """A long W1 study (--speed-trials) with tune.batch=64 against sequential, random sampler seed 0."""
    rows = []
    for batch, trials in ((1, args.speed_sequential_trials or args.speed_trials), (64, args.speed_trials)):
        with tempfile.TemporaryDirectory() as tmp:
            row = run_study(WORKLOADS["W1"], trials, batch, Path(tmp))
        scale = args.speed_trials / trials
        rows.append({**row, "trials": trials, "seconds_for_all": row["seconds"] * scale,
                     "cpu_seconds_for_all": row["cpu_seconds"] * scale})
    speedup = rows[0]["seconds_for_all"] / rows[1]["seconds_for_all"]
    cpu_speedup = rows[0]["cpu_seconds_for_all"] / rows[1]["cpu_seconds_for_all"]
    print(f"\nW1: a {args.speed_trials}-trial study (sampler=random, seed 0), 1 thread; load {_load()}")
    print(f"  {'mode':<16}{'trials run':>11}{'wall s':>9}{'trials/min':>12}{f's for {args.speed_trials}':>12}"
          f"{'CPU s':>9}{f'CPU s for {args.speed_trials}':>16}")
    for row in rows:
        mode = "sequential" if row["batch"] == 1 else f"tune.batch={row['batch']}"
        print(f"  {mode:<16}{row['trials']:>11}{row['seconds']:>9.1f}{row['trials_per_min']:>12.1f}"
              f"{row['seconds_for_all']:>12.1f}{row['cpu_seconds']:>9.1f}{row['cpu_seconds_for_all']:>16.1f}")
    print(f"  speed-up {speedup:.2f}x wall, {cpu_speedup:.2f}x CPU (goals: >= 5x; {args.speed_trials} trials <= 90 s)")
    return {"rows": rows, "speedup": speedup, "cpu_speedup": cpu_speedup}


def section_hyperband(args) -> dict:
    """Batch-native Hyperband against full-budget trials, both TPE with tune.batch=16, at equal trial counts
    (--trials), W1, study seeds 0..hyperband_seeds-1: wall seconds, local steps spent, best value."""
    rows = {}
    for mode, extra in (("TPE batch=16", ()), ("TPE+Hyperband batch=16", ("tune.pruner.name=hyperband",))):
        runs = []
        for seed in range(args.hyperband_seeds):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(run_study(WORKLOADS["W1"], args.trials, 16, Path(tmp),
                                      ("tune.sampler.name=tpe", *extra, f"tune.sampler.seed={seed}")))
        rows[mode] = runs
    print(f"\nW1: {args.trials}-trial TPE studies with tune.batch=16, seeds 0..{args.hyperband_seeds - 1}, 1 thread; "
          f"load {_load()}")
    print(f"  {'mode':<24}{'wall s':>9}{'x full':>8}{'CPU s':>8}{'x full':>8}{'local steps':>13}{'x full':>8}  "
          "best train_loss per seed")
    totals = {mode: [sum(r[k] for r in runs) for k in ("seconds", "cpu_seconds", "steps_spent")]
              for mode, runs in rows.items()}
    full_wall, full_cpu, full_steps = totals["TPE batch=16"]
    for mode, (wall, cpu, steps) in totals.items():
        bests = ", ".join(f"{r['best_value']:.5f}" for r in rows[mode])
        print(f"  {mode:<24}{wall:>9.1f}{wall / full_wall:>8.2f}{cpu:>8.1f}{cpu / full_cpu:>8.2f}{steps:>13}"
              f"{steps / full_steps:>8.2f}  {bests}")
    return rows


def _load() -> str:
    """The machine's load averages (1, 5, 15 min): the timings are only as good as the machine was idle."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


STARTUP_RUN = ["run", "rounds=1", "reference=off", "heterogeneity=false"]  # issue 18's one-round run


def _command() -> list[str]:
    """The installed `fedharness` command beside this interpreter (python -m fedharness.cli without one)."""
    script = Path(sys.executable).parent / "fedharness"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fedharness.cli"]


def _child_seconds(cmd: list[str], cwd: str) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one whole process."""
    before = os.times()
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def section_startup(args) -> dict:
    """A one-round run's whole process against `python -c "import torch"`, in turn (torch, run, torch, run, ...)
    after one warm-up each, so that a machine whose speed drifts shifts both; the medians of the pairs' ratios."""
    run = [*_command(), *STARTUP_RUN]
    torch_only = [sys.executable, "-c", "import torch"]
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:  # the run's results/ lands here
        for i in range(args.startup_reps + 1):
            base, whole = _child_seconds(torch_only, tmp), _child_seconds(run, tmp)
            if i:  # the first pair warms the file cache
                pairs.append((base, whole))
    wall = statistics.median(w[0] / b[0] for b, w in pairs)
    cpu = statistics.median(w[1] / b[1] for b, w in pairs)
    record = {"reps": len(pairs), "ratio_wall": wall, "ratio_cpu": cpu,
              "torch_import_wall_s": statistics.median(b[0] for b, _ in pairs),
              "run_wall_s": statistics.median(w[0] for _, w in pairs)}
    print(f"\nstart-up: `fedharness {' '.join(STARTUP_RUN)}` vs `python -c 'import torch'`, {len(pairs)} pairs "
          f"in turn (goal <= 1.2x)")
    print(f"  median wall s: run {record['run_wall_s']:.2f}, torch import {record['torch_import_wall_s']:.2f}; "
          f"median ratio: wall {wall:.2f}x, cpu {cpu:.2f}x")
    return record


def section_process(args) -> dict:
    """`fedharness tune` for the 64-trial W1 study (run_study's overrides), sequential and tune.batch=64, each a whole
    process in a fresh results folder, in turn (sequential, batched, ...) after one warm-up pair: a machine whose
    speed drifts shifts both of a pair. The medians of each mode's wall and CPU seconds and of the pairs' ratios."""
    w1 = WORKLOADS["W1"]
    study = [*_command(), "tune", *STUDY, *w1["tune"], f"tune.n_trials={args.trials}", "progress=false", *w1["run"]]
    pairs = []
    for i in range(args.process_pairs + 1):
        pair = []
        for batch in (1, min(64, args.trials)):
            with tempfile.TemporaryDirectory() as tmp:
                pair.append(_child_seconds([*study, f"tune.batch={batch}", f"results_dir={tmp}/results"], tmp))
        if i:  # the first pair warms the file cache (and the exact reference's cache after a code change)
            pairs.append(pair)
    record = {"pairs": len(pairs), "load_after": _load(),
              "sequential_wall_s": statistics.median(s[0] for s, _ in pairs),
              "batched_wall_s": statistics.median(b[0] for _, b in pairs),
              "sequential_cpu_s": statistics.median(s[1] for s, _ in pairs),
              "batched_cpu_s": statistics.median(b[1] for _, b in pairs),
              "ratio_wall": statistics.median(s[0] / b[0] for s, b in pairs),
              "ratio_cpu": statistics.median(s[1] / b[1] for s, b in pairs),
              "ratios_wall": [s[0] / b[0] for s, b in pairs]}
    print(f"\nW1: a {args.trials}-trial study as `fedharness tune` runs it (whole processes), {len(pairs)} pairs in "
          f"turn; load {_load()}")
    print(f"  median wall s: sequential {record['sequential_wall_s']:.2f}, tune.batch=64 {record['batched_wall_s']:.2f}"
          f"; median CPU s: {record['sequential_cpu_s']:.2f}, {record['batched_cpu_s']:.2f}")
    print(f"  median ratio: wall {record['ratio_wall']:.2f}x, cpu {record['ratio_cpu']:.2f}x (goal >= 5x); pairs' wall "
          f"ratios {', '.join(f'{r:.2f}' for r in record['ratios_wall'])}")
    return record


SECTIONS: dict[str, Callable[[argparse.Namespace], dict]] = {"batched_studies": section_batched_studies,
                                                         "startup": section_startup, "quality": section_quality,
                                                         "speed": section_speed, "hyperband": section_hyperband,
                                                         "process": section_process}


def warm_up(args) -> None:
    """A 2-trial study of each workload before any timing: the first study of a process (and the first after a
    code change) pays the imports and the exact reference's solve (cached in ~/.cache/fedharness), seconds that
    would otherwise land on whichever mode runs first."""
    for name, workload in WORKLOADS.items():
        if not (args.skip_cnn and name.startswith("CNN")):
            with tempfile.TemporaryDirectory() as tmp:
                run_study(workload, 2, 1, Path(tmp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-cnn", action="store_true")
    parser.add_argument("--startup-reps", type=int, default=7, help="pairs of processes for the start-up ratio")
    parser.add_argument("--seeds", type=int, default=10, help="study seeds of the quality section")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=list(QUALITY_MODES),
                        help="comma-separated modes of the quality section: " + ", ".join(QUALITY_MODES))
    parser.add_argument("--speed-trials", type=int, default=1000)
    parser.add_argument("--speed-sequential-trials", type=int, default=None,
                        help="run the sequential study of the speed section on fewer trials, extrapolating its rate")
    parser.add_argument("--process-pairs", type=int, default=5, help="pairs of whole processes, process section")
    parser.add_argument("--hyperband-seeds", type=int, default=3, help="study seeds of the hyperband section")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fedharness.register_dataset("noise_images", noise_images, num_clients=10)
    record = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
              "torch": torch.__version__, "trials": args.trials}
    print(f"bench_tune on {record['machine']}, torch threads={args.threads}, load {_load()}")
    warm_up(args)
    for name in args.sections.split(","):
        record[name] = SECTIONS[name](args)
        record[f"{name}_load_after"] = _load()
        print(f"  (load after {name}: {_load()})")
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "tune.json").write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
