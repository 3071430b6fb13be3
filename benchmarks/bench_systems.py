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

Clients that are late (issue 40): what FedBuff's server step costs (docs/async.md, algorithms/cadences.py).

3. Population, asynchronous: the population of 1. without the deadline (FedBuff refuses one) and with a sampler
   without replacement (yang_s2, C = 100 draws a version, the free slots taking the first online ones not in
   flight), cadence=fedbuff, C = 100, M = 10: N = 10^3 against N = 10^8, fresh processes alternating pair by
   pair as in 1., S server steps each (engine.step). The updates in flight are C x dim float64 per replica (8 KB at
   d = 10). Goals: set-up and peak memory within 10%; ms per server step reported (and its ratio).
4. W1, asynchronous: W1 with yang_s2 (K = 10) and lognormal speeds (sigma 0.5 for step time and bandwidth, always
   online, a 0.05 s step and a 0.01 MB/s link as in docs/async.md's example) four ways in one process, taking turns
   step by step (the order rotating): *plain* (yang_s2, no systems keys), *sync* (synchronous FedAvg at K = 10 on
   the systems clock), *fedbuff C=10* (C = M = K = 10 with refill=step: the synchronous round, so the same bits as
   sync: what the asynchronous machinery alone costs) and *fedbuff C=20* (C = 20, M = 10, Algorithm 1's refill at
   each arrival: each step takes 10 arrivals and starts about 10 clients, so it trains about 10 clients a step,
   as sync does, from models up to a few versions old, with one sampler draw per arrival). Each step's training (executor.local_updates) is timed apart, so a step = training + the rest
   (planning, the flight's bookkeeping, the aggregate and the server step). A process's ratio is the median of one
   configuration's steps over the median of sync's; the median of the processes' ratios and their spread are
   reported.

Prints a table and writes benchmarks/out/systems.json.

    python benchmarks/bench_systems.py [--pairs 3 --rounds 20 --w1-procs 6 --w1-rounds 60
                                        --async-pairs 3 --async-steps 200 --async-procs 6 --async-rounds 100]
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
              "network.compute_s_per_step=0.01", "speed=lognormal", "speed.step_sigma=0.5",
              "speed.bandwidth_sigma=0.5", "availability=duty_cycle", "availability.duty_cycle=0.5",
              "availability.period_s=5", "cadence.deadline_s=0.3"]
# conf/sweep/compression.yaml's W1 (model auto: logistic regression; fedavg's scheme I, E = 20, b = 24, lr 0.05)
W1 = ["dataset=synthetic", "dataset.num_clients=100", "dataset.samples_per_client=200", "dataset.data_seed=0",
      "algorithm.clients_per_round=10", "reference=off"]
ON_TIME = ["speed=lognormal", "speed.step_sigma=0.5", "availability=duty_cycle",
           "availability.duty_cycle=1.0", "cadence.deadline_s=1000000"]
CONFIGS = {"plain": [],  # today's: no systems keys
           "speeds": ["speed=lognormal", "speed.step_sigma=0.5", "cadence.deadline_s=1000000"],
           "systems": ON_TIME}
# 3.: 1.'s population under FedBuff: no deadline (refused with cadence=fedbuff), a sampler without replacement
ASYNC_POPULATION = [o for o in POPULATION if not o.startswith(("algorithm.sampler=", "cadence.deadline_s="))] + [
    "algorithm.sampler=yang_s2", "cadence=fedbuff", "cadence.concurrency=100", "cadence.buffer=10"]
# 4.: W1 with a sampler FedBuff accepts (yang_s2: sync and fedbuff draw alike), lognormal speeds, always online
ASYNC_W1 = [*W1, "algorithm.sampler=yang_s2"]
LATE = ["speed=lognormal", "speed.step_sigma=0.5", "speed.bandwidth_sigma=0.5",
        "network.compute_s_per_step=0.05", "network.bandwidth_MB_per_s=0.01"]
ASYNC_CONFIGS = {"plain": [],  # yang_s2, no systems keys
                 "sync": LATE,  # synchronous FedAvg, K = 10, on the systems clock
                 # refill=step: the K start together and the step waits for all, whatever their speeds
                 "fedbuff_c10": [*LATE, "cadence=fedbuff", "cadence.concurrency=10", "cadence.buffer=10",
                                 "cadence.refill=step"],
                 "fedbuff_c20": [*LATE, "cadence=fedbuff", "cadence.concurrency=20", "cadence.buffer=10"]}
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


def population_child(n: int, rounds: int, t0: float, mode: str = "sync") -> dict:
    """One population case alone in this process (t0: the parent's time.time() just before it started it; mode:
    sync, 1.'s rounds, or fedbuff, 3.'s server steps)."""
    after_start = time.time() - t0
    import numpy as np
    import torch

    from fedharness.config.load import load_settings
    from fedharness.runs.execute import build_engine, build_executor, prepare_run

    torch.set_num_threads(1)
    imports_s, after_imports = time.time() - t0, peak_rss_bytes()
    start = time.perf_counter()
    overrides = POPULATION if mode == "sync" else ASYNC_POPULATION
    run = prepare_run(load_settings([*overrides, *COMMON, f"dataset.num_clients={n}", f"rounds={rounds}"]))
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
            "clients_trained": float(state.counters["grad_evals"][0]) / run.settings.algorithm.batch_size
            / run.settings.algorithm.local_steps,
            "held_kb": sum(v.nbytes if isinstance(v, np.ndarray) else v.element_size() * v.nelement()
                           for v in state.in_flight.values()) / 1024,
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


def population(pairs: int, rounds: int, lines: list[str], mode: str = "sync") -> dict:
    small, large = 10**3, 10**8
    cases: dict[int, list[dict]] = {small: [], large: []}
    if mode == "sync":
        title = (f"1. quadratic_lazy, lognormal speeds, duty cycle 0.5 of 5 s, deadline 0.3 s, K=100 (scheme I), "
                 f"20 steps, {rounds} rounds a process; {pairs} pairs of processes")
    else:
        title = (f"3. quadratic_lazy, lognormal speeds, duty cycle 0.5 of 5 s, no deadline, FedBuff C=100 M=10 "
                 f"(yang_s2), 20 steps, {rounds} server steps a process (a 'round' below: a server step); {pairs} "
                 f"pairs of processes")
    lines += ["", title,
              "| pair | N | set-up s (process start to round 1) | build s | ms/round (mean) | ms/round (rounds 2+) | "
              "peak RSS MB | VmHWM MB | after imports MB | participants/round | sim_s |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines[-4:]), flush=True)
    for i in range(pairs):
        for n in ([small, large] if i % 2 == 0 else [large, small]):
            m = run_child(__file__, "population", {"n": n, "rounds": rounds, "t0": time.time(), "mode": mode},
                          CHILD_ENV)
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
    if mode != "sync":
        lines.append(f"clients trained per process (median) N = 10^3: "
                     f"{median(c['clients_trained'] for c in cases[small]):.0f}, N = 10^8: "
                     f"{median(c['clients_trained'] for c in cases[large]):.0f}; held in flight: "
                     f"{cases[large][0]['held_kb']:.1f} KB")
        print(lines[-1], flush=True)
    overrides = POPULATION if mode == "sync" else ASYNC_POPULATION
    return {"overrides": [*overrides, *COMMON], "rounds": rounds, "cases": {str(n): c for n, c in cases.items()},
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


def async_w1_child(rounds: int, first: str) -> dict:
    """4.: W1 plain, sync, FedBuff C = M = 10 and FedBuff C = 20, M = 10 in one process, taking turns server step by
    server step (the order rotating every step); each step's training (executor.local_updates) timed apart."""
    import torch

    from fedharness.config.load import load_settings
    from fedharness.runs.execute import build_engine, build_executor, prepare_run

    torch.set_num_threads(1)
    engines, training = {}, {}
    for name, extra in ASYNC_CONFIGS.items():
        run = prepare_run(load_settings([*ASYNC_W1, *COMMON, *extra, f"rounds={WARMUP + rounds}"]))
        assert (run.clock is None) == (name == "plain"), name
        assert (run.cadence is not None and run.cadence.spans_versions) == name.startswith("fedbuff"), name
        executor = build_executor(run.settings, run.problem, run.algorithm.solver)
        training[name] = [0.0]
        executor.local_updates = timed(executor.local_updates, training[name])
        engine = build_engine(run, executor)
        engines[name] = [engine, engine.initial_state()]
    names = list(ASYNC_CONFIGS)
    names = names[names.index(first):] + names[:names.index(first)]
    times: dict[str, list[float]] = {name: [] for name in names}
    train: dict[str, list[float]] = {name: [] for name in names}
    evals: dict[str, int] = {}
    for r in range(WARMUP + rounds):
        if r == WARMUP:
            evals = {name: int(engines[name][1].counters["grad_evals"][0]) for name in names}
        for name in names[r % len(names):] + names[:r % len(names)]:
            engine, state = engines[name]
            before = training[name][0]
            t = time.perf_counter()
            engines[name][1] = engine.step(state)
            if r >= WARMUP:
                times[name].append(time.perf_counter() - t)
                train[name].append(training[name][0] - before)
    b, e = int(run.settings.algorithm.batch_size), int(run.settings.algorithm.local_steps)  # the same in all four
    x = {name: engines[name][1].x for name in names}
    return {"s_per_step": times, "train_s_per_step": train,
            "clients_per_step": {name: (int(engines[name][1].counters["grad_evals"][0]) - evals[name]) / b / e
                                 / rounds for name in names},
            "participants_last": {name: int(engines[name][1].counters["participants"][0]) for name in names},
            "same_bits_c10": bool(torch.equal(x["sync"], x["fedbuff_c10"])),
            "same_bits_plain": bool(torch.equal(x["sync"], x["plain"])),
            "max_abs_diff_c10": float((x["sync"] - x["fedbuff_c10"]).abs().max()),
            "sim_s": {name: float(engines[name][1].counters["sim_s"][0]) for name in names}}


def timed(fn, total: list[float]):
    """fn, adding the seconds each call takes to total[0]."""
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t
    return wrapper


def async_w1(procs: int, rounds: int, lines: list[str]) -> dict:
    names = list(ASYNC_CONFIGS)
    lines += ["", f"4. W1 with yang_s2 (K=10) and lognormal speeds ({' '.join(LATE)}), always online: plain (no "
              f"systems keys), sync, fedbuff C=10 M=10, fedbuff C=20 M=10, all four in one process taking turns step "
              f"by step, "
              f"{rounds} timed server steps each after {WARMUP}; {procs} processes. ms/step: each process's median "
              f"(training: executor.local_updates; rest: the step less its training)",
              "| process | first | plain ms | sync ms | fedbuff C=10 ms | fedbuff C=20 ms | C=10 / sync | "
              "C=20 / sync | rest ms sync / C=10 / C=20 | clients a step sync / C=20 | C=10 same bits as sync |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    print("\n".join(lines[-4:]), flush=True)
    results = []
    for i in range(procs):
        first = names[i % len(names)]
        out = run_child(__file__, "async_w1", {"rounds": rounds, "first": first}, CHILD_ENV)
        ms = {k: 1000 * median(out["s_per_step"][k]) for k in names}
        rest = {k: 1000 * median(s - t for s, t in zip(out["s_per_step"][k], out["train_s_per_step"][k]))
                for k in names}
        out.update(first=first, ms=ms, rest_ms=rest, c10_ratio=ms["fedbuff_c10"] / ms["sync"],
                   c20_ratio=ms["fedbuff_c20"] / ms["sync"], sync_ratio=ms["sync"] / ms["plain"])
        results.append(out)
        cps = out["clients_per_step"]
        lines.append(f"| {i + 1} | {first} | {ms['plain']:.2f} | {ms['sync']:.2f} | {ms['fedbuff_c10']:.2f} | "
                     f"{ms['fedbuff_c20']:.2f} | {out['c10_ratio']:.3f} | {out['c20_ratio']:.3f} | "
                     f"{rest['sync']:.2f} / {rest['fedbuff_c10']:.2f} / {rest['fedbuff_c20']:.2f} | "
                     f"{cps['sync']:.1f} / {cps['fedbuff_c20']:.1f} | {out['same_bits_c10']} |")
        print(lines[-1], flush=True)

    def spread(key: str) -> tuple[float, float, float]:
        v = [r[key] for r in results]
        return median(v), min(v), max(v)

    med_ms = {k: median(r["ms"][k] for r in results) for k in names}
    med_rest = {k: median(r["rest_ms"][k] for r in results) for k in names}
    summary = {"c10_over_sync": spread("c10_ratio"), "c20_over_sync": spread("c20_ratio"),
               "sync_over_plain": spread("sync_ratio"), "median_ms": med_ms, "median_rest_ms": med_rest,
               "same_bits_c10": all(r["same_bits_c10"] for r in results), "processes": results,
               "overrides": [*ASYNC_W1, *COMMON], "configs": ASYNC_CONFIGS}
    lines += [f"median over {procs} processes (min, max): fedbuff C=20 / sync {fmt(summary['c20_over_sync'])}; "
              f"fedbuff C=10 / sync {fmt(summary['c10_over_sync'])}; sync / plain {fmt(summary['sync_over_plain'])}",
              f"median ms/step plain {med_ms['plain']:.2f}, sync {med_ms['sync']:.2f}, C=10 "
              f"{med_ms['fedbuff_c10']:.2f}, C=20 {med_ms['fedbuff_c20']:.2f}; the rest (not training): plain "
              f"{med_rest['plain']:.2f}, sync "
              f"{med_rest['sync']:.2f}, C=10 {med_rest['fedbuff_c10']:.2f}, C=20 {med_rest['fedbuff_c20']:.2f}; "
              f"C=10 the same bits as sync in every process: {summary['same_bits_c10']}"]
    print("\n".join(lines[-2:]), flush=True)
    return summary


def fmt(v: tuple[float, float, float]) -> str:
    return f"{v[0]:.3f} ({v[1]:.3f}, {v[2]:.3f})"


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        payload = json.loads(sys.argv[3])
        if sys.argv[2] == "population":
            result = population_child(payload["n"], payload["rounds"], payload["t0"], payload.get("mode", "sync"))
        elif sys.argv[2] == "async_w1":
            result = async_w1_child(payload["rounds"], payload["first"])
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
    parser.add_argument("--async-pairs", type=int, default=3, help="pairs of FedBuff N = 10^3 and N = 10^8 processes "
                                                                   "(0: none)")
    parser.add_argument("--async-steps", type=int, default=200, help="server steps a FedBuff population process times")
    parser.add_argument("--async-procs", type=int, default=6, help="W1 processes, each timing plain, sync and FedBuff "
                                                                   "at C = 10 and 20 (0: none)")
    parser.add_argument("--async-rounds", type=int, default=100, help="timed server steps of each configuration a "
                                                                      "process")
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
    if args.async_pairs:
        record["async_population"] = population(args.async_pairs, args.async_steps, lines, mode="fedbuff")
    if args.async_procs:
        record["async_w1"] = async_w1(args.async_procs, args.async_rounds, lines)
    record["duration_s"] = time.perf_counter() - start
    lines += ["", f"{record['duration_s']:.0f} s in all; load average {os.getloadavg()[0]:.2f} at the end"]
    print("\n\nsummary:", flush=True)
    publish(record, lines, "systems")


if __name__ == "__main__":
    main()
