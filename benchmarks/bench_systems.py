"""Clients that are slow and absent (issue 39): what the systems clock costs at N = 10^8 and on W1.

1. Population: dataset=quadratic_lazy (d = 10), scheme I (K = 100 draws by p_k = 1/N: blockwise, O(K)),
   20 local steps, 1 thread, with lognormal speeds (sigma 0.5 for step time and bandwidth), a duty cycle of 0.5
   over 5 s, network.compute_s_per_step=0.01 and a deadline of 0.3 s (the median client needs 0.2 s: about a
   fifth miss it, and half the population is offline at any time). N = 10^3 and N = 10^8, each case a fresh
   process, the two alternating pair by pair (their order swapped every pair). Each process reports its set-up
   (from the parent's clock just before it started the process to the first round: the interpreter, the
   imports, building the run; and the build alone: prepare_run, the executor, the engine, its initial state),
   the mean milliseconds of its R rounds (engine.step; evaluation is not a round's work here), and its peak
   resident memory (getrusage's ru_maxrss, and /proc/self/status VmHWM). Goals: set-up and peak memory at
   N = 10^8 within 10% of N = 10^3, a round within 20%.
2. W1 (Synthetic(1,1), 100 clients x 200 samples, logistic regression, scheme I with K = 10, E = 20, b = 24,
   lr 0.05, 1 thread): a round with systems profiles under which every client is on time ("systems": lognormal
   speeds, duty_cycle=1.0, deadline 10^6 s) against today's round ("plain": no systems keys), and, to tell the
   clock's two halves apart, lognormal speeds and the deadline alone ("speeds": every client always online).
   Each process builds the three runs and times them taking turns round by round (the order rotating), so load
   from other work hits them alike; a process's ratio is the median of its systems rounds over the median of its
   plain rounds. Then each engine's plan_round alone (the sampler and the clock, where the systems section's work
   is), taking turns call by call: its median microseconds. The median of the processes' ratios and their spread
   are reported; the runs' models must end the same bits (every client on time: the same clients, weights and
   steps). Goal: within 5%.

Prints a table and writes benchmarks/out/systems.json.

    python benchmarks/bench_systems.py [--pairs 3 --rounds 20 --w1-procs 6 --w1-rounds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from statistics import median

sys.path.insert(0, os.path.dirname(__file__))
from children import run_child  # noqa: E402
from outputs import publish  # noqa: E402

CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
COMMON = ["threads=1", "progress=false", "heterogeneity=false", "eval_every=1000000"]
POPULATION = ["dataset=quadratic_lazy", "algorithm.sampler=scheme_i", "algorithm.clients_per_round=100",
              "algorithm.local_steps=20", "algorithm.batch_size=24", "algorithm.client_lr=0.05",
              "network.compute_s_per_step=0.01", "systems.speed=lognormal", "systems.speed_sigma=0.5",
              "systems.bandwidth_sigma=0.5", "systems.availability=duty_cycle", "systems.duty_cycle=0.5",
              "systems.period_s=5", "systems.deadline_s=0.3"]
# conf/sweep/compression.yaml's W1 (model auto: logistic regression; fedavg's scheme I, E = 20, b = 24, lr 0.05)
W1 = ["dataset=synthetic", "dataset.num_clients=100", "dataset.samples_per_client=200", "dataset.data_seed=0",
      "algorithm.clients_per_round=10", "reference=off"]
ON_TIME = ["systems.speed=lognormal", "systems.speed_sigma=0.5", "systems.availability=duty_cycle",
           "systems.duty_cycle=1.0", "systems.deadline_s=1000000"]
CONFIGS = {"plain": [],  # today's: no systems keys
           "speeds": ["systems.speed=lognormal", "systems.speed_sigma=0.5", "systems.deadline_s=1000000"],
           "systems": ON_TIME}
PLAN_CALLS = 300
WARMUP = 2
MB = 2**20


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def population_child(n: int, rounds: int, t0: float) -> dict:
    """One population case alone in this process (t0: the parent's time.time() just before it started it)."""
    after_start = time.time() - t0
    import numpy as np
    import torch

    from fedharness.config.load import load_settings
    from fedharness.runs.execute import build_engine, build_executor, prepare_run

    torch.set_num_threads(1)
    imports_s, after_imports = time.time() - t0, peak_rss_bytes()
    start = time.perf_counter()
    run = prepare_run(load_settings([*POPULATION, *COMMON, f"dataset.num_clients={n}", f"rounds={rounds}"]))
    engine = build_engine(run, build_executor(run.settings, run.problem, run.algorithm.solver))
    state = engine.initial_state()
    build_s, setup_s = time.perf_counter() - start, time.time() - t0
    after_build = peak_rss_bytes()
    times, participants = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        state = engine.step(state)
        times.append(time.perf_counter() - t)
        participants.append(int(state.counters["participants"][0]))
    return {"setup_s": setup_s, "build_s": build_s, "imports_s": imports_s, "interpreter_s": after_start,
            "ms_per_round": 1000 * float(np.mean(times)), "ms_rounds_2_on": 1000 * float(np.mean(times[1:])),
            "ms_first_round": 1000 * times[0], "peak_mb": peak_rss_bytes() / MB, "vm_hwm_mb": vm_hwm_bytes() / MB,
            "after_imports_mb": after_imports / MB, "after_build_mb": after_build / MB,
            "sim_s": float(state.counters["sim_s"][0]), "mean_participants": float(np.mean(participants)),
            "clock": type(run.clock).__name__, "sampler": type(run.algorithm.sampler).__name__}


def w1_child(rounds: int, first: str) -> dict:
    """W1 plain, W1 with lognormal speeds and a deadline only (every client always online) and W1 with every
    systems profile on time, in one process, taking turns round by round (the order rotating every round); then
    each engine's plan_round alone (the sampler and the clock: where the systems section's work is), taking turns
    call by call."""
    import numpy as np
    import torch

    from fedharness.config.load import load_settings
    from fedharness.runs.execute import build_engine, build_executor, prepare_run

    torch.set_num_threads(1)
    engines = {}
    for name, extra in CONFIGS.items():
        run = prepare_run(load_settings([*W1, *COMMON, *extra, f"rounds={WARMUP + rounds}"]))
        assert (run.clock is None) == (name == "plain"), name
        engine = build_engine(run, build_executor(run.settings, run.problem, run.algorithm.solver))
        engines[name] = [engine, engine.initial_state()]
    names = list(CONFIGS)
    names = names[names.index(first):] + names[:names.index(first)]
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(WARMUP + rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            engine, state = engines[name]
            t = time.perf_counter()
            engines[name][1] = engine.step(state)
            if r >= WARMUP:
                times[name].append(time.perf_counter() - t)
    plan: dict[str, list[float]] = {name: [] for name in names}
    for i in range(PLAN_CALLS):
        for name in names[i % len(names):] + names[:i % len(names)]:
            engine, state = engines[name]
            t = time.perf_counter()
            engine.plan_round(WARMUP + rounds, state.counters["sim_s"])
            plan[name].append(time.perf_counter() - t)
    x = {name: engines[name][1].x for name in names}
    return {"s_per_round": times, "plan_round_us": {k: 1e6 * float(np.median(v)) for k, v in plan.items()},
            "same_bits": all(bool(torch.equal(x["plain"], x[k])) for k in names),
            "max_abs_diff": max(float((x["plain"] - x[k]).abs().max()) for k in names),
            "sim_s": {name: float(engines[name][1].counters["sim_s"][0]) for name in names}}


def population(pairs: int, rounds: int, lines: list[str]) -> dict:
    small, large = 10**3, 10**8
    cases: dict[int, list[dict]] = {small: [], large: []}
    lines += ["", f"1. quadratic_lazy, lognormal speeds, duty cycle 0.5 of 5 s, deadline 0.3 s, K=100 (scheme I), "
              f"20 steps, {rounds} rounds a process; {pairs} pairs of processes",
              "| pair | N | set-up s (process start to round 1) | build s | ms/round (mean) | ms/round (rounds 2+) | "
              "peak RSS MB | VmHWM MB | after imports MB | participants/round | sim_s |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines[-4:]), flush=True)
    for i in range(pairs):
        for n in ([small, large] if i % 2 == 0 else [large, small]):
            m = run_child(__file__, "population", {"n": n, "rounds": rounds, "t0": time.time()}, CHILD_ENV)
            cases[n].append(m)
            lines.append(f"| {i + 1} | 10^{len(str(n)) - 1} | {m['setup_s']:.2f} | {m['build_s']:.3f} | "
                         f"{m['ms_per_round']:.2f} | {m['ms_rounds_2_on']:.2f} | {m['peak_mb']:.0f} | "
                         f"{m['vm_hwm_mb']:.0f} | {m['after_imports_mb']:.0f} | {m['mean_participants']:.1f} | "
                         f"{m['sim_s']:.2f} |")
            print(lines[-1], flush=True)
    keys = ["setup_s", "build_s", "ms_per_round", "ms_rounds_2_on", "peak_mb", "vm_hwm_mb"]
    med = {n: {k: median(c[k] for c in cases[n]) for k in keys} for n in cases}
    ratio = {k: med[large][k] / med[small][k] for k in keys}
    pair_ratio = {k: [b[k] / a[k] for a, b in zip(cases[small], cases[large])] for k in keys}
    goal = {"setup_s": 1.10, "peak_mb": 1.10, "vm_hwm_mb": 1.10, "ms_per_round": 1.20, "ms_rounds_2_on": 1.20,
            "build_s": None}
    lines += ["", "| median over the pairs | N = 10^3 | N = 10^8 | 10^8 / 10^3 | per pair | goal |",
              "|---|---:|---:|---:|---|---|"]
    for k in keys:
        lines.append(f"| {k} | {med[small][k]:.3f} | {med[large][k]:.3f} | {ratio[k]:.3f} | "
                     f"{', '.join(f'{v:.2f}' for v in pair_ratio[k])} | "
                     f"{'-' if goal[k] is None else f'<= {goal[k]:.2f}'} |")
    print("\n".join(lines[-len(keys) - 3:]), flush=True)
    return {"overrides": [*POPULATION, *COMMON], "rounds": rounds, "cases": {str(n): c for n, c in cases.items()},
            "medians": {str(n): v for n, v in med.items()}, "ratio_large_over_small": ratio,
            "pair_ratios": pair_ratio}


def w1(procs: int, rounds: int, lines: list[str]) -> dict:
    lines += ["", f"2. W1: plain (no systems keys), speeds ({' '.join(CONFIGS['speeds'])}) and systems "
              f"({' '.join(ON_TIME)}): all three in one process, taking turns round by round, {rounds} timed rounds "
              f"each after {WARMUP}; {procs} processes. ms/round: each process's median; plan_round: its median of "
              f"{PLAN_CALLS} calls",
              "| process | first | plain ms/round | speeds ms/round | systems ms/round | systems / plain | "
              "speeds / plain | plan_round us plain / speeds / systems | same bits |",
              "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    print("\n".join(lines[-4:]), flush=True)
    results = []
    for i in range(procs):
        first = list(CONFIGS)[i % len(CONFIGS)]
        out = run_child(__file__, "w1", {"rounds": rounds, "first": first}, CHILD_ENV)
        ms = {k: 1000 * median(out["s_per_round"][k]) for k in CONFIGS}
        out.update(first=first, ms=ms, ratio=ms["systems"] / ms["plain"], speeds_ratio=ms["speeds"] / ms["plain"])
        results.append(out)
        plan = out["plan_round_us"]
        lines.append(f"| {i + 1} | {first} | {ms['plain']:.2f} | {ms['speeds']:.2f} | {ms['systems']:.2f} | "
                     f"{out['ratio']:.3f} | {out['speeds_ratio']:.3f} | "
                     f"{plan['plain']:.0f} / {plan['speeds']:.0f} / {plan['systems']:.0f} | {out['same_bits']} |")
        print(lines[-1], flush=True)
    ratios = [r["ratio"] for r in results]
    speeds = [r["speeds_ratio"] for r in results]
    med_ms = {k: median(r["ms"][k] for r in results) for k in CONFIGS}
    med_plan = {k: median(r["plan_round_us"][k] for r in results) for k in CONFIGS}
    summary = {"median_ratio": median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
               "speeds_median_ratio": median(speeds), "speeds_min_ratio": min(speeds),
               "speeds_max_ratio": max(speeds), "median_ms": med_ms, "median_plan_round_us": med_plan,
               "same_bits": all(r["same_bits"] for r in results), "processes": results,
               "overrides": [*W1, *COMMON], "configs": CONFIGS}
    lines += [f"systems / plain: median {summary['median_ratio']:.3f} over {procs} processes (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}); speeds / plain: median {median(speeds):.3f} (min {min(speeds):.3f}, max "
              f"{max(speeds):.3f}); goal: within 5%",
              f"median ms/round plain {med_ms['plain']:.2f}, speeds {med_ms['speeds']:.2f}, systems "
              f"{med_ms['systems']:.2f}; median plan_round us plain {med_plan['plain']:.0f}, speeds "
              f"{med_plan['speeds']:.0f}, systems {med_plan['systems']:.0f}; same bits in every process: "
              f"{summary['same_bits']}"]
    print("\n".join(lines[-2:]), flush=True)
    return summary


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        payload = json.loads(sys.argv[3])
        if sys.argv[2] == "population":
            result = population_child(payload["n"], payload["rounds"], payload["t0"])
        else:
            result = w1_child(payload["rounds"], payload["first"])
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="pairs of N = 10^3 and N = 10^8 processes (0: none)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds a population process times")
    parser.add_argument("--w1-procs", type=int, default=6, help="W1 processes, each timing the three configurations "
                                                                "(0: none)")
    parser.add_argument("--w1-rounds", type=int, default=60, help="timed rounds of each configuration a process")
    args = parser.parse_args()
    start, load = time.perf_counter(), os.getloadavg()
    lines = [f"{platform.node()}, {os.cpu_count()} CPU(s), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
             f"at the start; 1 torch thread"]
    print(lines[0], flush=True)
    record: dict = {"host": platform.node(), "cpus": os.cpu_count(), "loadavg_at_start": load,
                    "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    if args.pairs:
        record["population"] = population(args.pairs, args.rounds, lines)
    if args.w1_procs:
        record["w1"] = w1(args.w1_procs, args.w1_rounds, lines)
    record["duration_s"] = time.perf_counter() - start
    lines += ["", f"{record['duration_s']:.0f} s in all; load average {os.getloadavg()[0]:.2f} at the end"]
    print("\n\nsummary:", flush=True)
    publish(record, lines, "systems")


if __name__ == "__main__":
    main()
