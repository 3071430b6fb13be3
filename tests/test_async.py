"""Clients that are late: FedBuff and FedAsync on the simulated clock, in the one round loop (algorithms/cadences.py),
checked against synchronous FedAvg and an event-driven simulation written here."""

from __future__ import annotations

import heapq

import numpy as np
import pytest

import fedharness.algorithms.cadences as flight_module
from fedharness.base import streams
from fedharness.cli import main
from fedharness.config.load import load_settings
from fedharness.core.checkpoint import load_resume
from fedharness.core.executors import InlineExecutor
from fedharness.algorithms.systems import ConstantStaleness, HingeStaleness, PolyStaleness
from fedharness.runs.batch import Slot
from fedharness.runs.execute import build_engine, execute, execute_batch, prepare_run
from test_systems import (BW_SIGMA, DIM, DUTY, K, LR, MB_PER_S, N, PERIOD, SEED, SIGMA, STEP_S, STEPS, StopAt,
                          client_profile, quadratic, rows)
from test_systems import world_rows as systems_world_rows

LOGNORMAL = ["speed=lognormal", f"speed.step_sigma={SIGMA}", f"speed.bandwidth_sigma={BW_SIGMA}"]


# --- a: the synchronous round is the special case C = M = K ----------------------------------------------------

TOPK = ["compress=topk", "compress.ratio=0.34"]  # k = 1 of the 3 coordinates, with error feedback
QSGD = ["compress=qsgd", "compress.levels=2"]  # stochastic rounding on the clients' own streams


@pytest.mark.parametrize("aggregator,refill,compress", [
    ("fedavg", "step", []), ("fednova", "step", []), ("fedavg", "arrival", []), ("fednova", "arrival", []),
    ("fedavg", "step", TOPK), ("fednova", "arrival", QSGD)])
def test_fedbuff_with_c_and_m_equal_to_k_and_equal_profiles_is_synchronous_fedavg_bit_for_bit(aggregator, refill,
                                                                                             compress, tmp_path):
    # refill=arrival starts a client the moment a slot frees: the K arrive together only if their local work is
    # equal too (each client's steps take the same time); refill=step waits for the step, so any local work is.
    # A compressed update (its bytes, its transfer time, its error feedback) is the synchronous round's, too.
    steps = [] if refill == "step" else [f"algorithm.client_steps=[{','.join(['3'] * N)}]"]
    common = ["rounds=6", "replicas=2", "eval_every=1", f"results_dir={tmp_path}",
              f"algorithm.aggregator={aggregator}", *steps, *compress]
    runs = {"sync": [], "fedbuff": ["cadence=fedbuff", f"cadence.concurrency={K}", f"cadence.buffer={K}",
                                    f"cadence.refill={refill}"]}
    got = {}
    for name, extra in runs.items():
        assert execute(load_settings(quadratic(*common, *extra)), run_id=name).status == "ok"
        got[name] = rows(tmp_path, name)
    assert got["fedbuff"] == got["sync"]
    assert len(got["sync"]) == 14 and got["sync"][-1][-1] == K and got["sync"][-1][-2] > 0  # K took part; clock ran
    if compress:  # the bytes up are the encoded updates' (a dense update: DIM x 8 bytes a client)
        assert got["sync"][-1][6] < 6 * K * DIM * 8


# --- b: an event-driven simulation, one client at a time --------------------------------------------------------

def simulate(e: np.ndarray, x: np.ndarray, versions: int, mode: str, C: int, M: int, max_staleness: int | None,
             alpha: float, exponent: float, duty: bool, refill: str, profile=client_profile, steps=STEPS):
    """FedBuff / FedAsync on F_i = 1/2 ||x - e_i||^2 with local GD: a heap of arrivals, one client at a time.
    Free slots take the first clients of a uniform order (keyed by the version and the arrivals so far in it)
    that are online (duty: a duty cycle), not in flight and not started from this version yet: with
    refill=arrival whenever no arrival is due at t (so simultaneous arrivals are all taken first), with refill=step
    at the version's start only, before the arrivals due then (those the last step left). The server takes
    arrivals by (time, client), drops the stale, steps after M (or when nobody is left and nobody can start;
    retry_s 60 when nothing arrived). Client k's (step s, MB/s, phase s) is `profile(k)`, its local steps
    `steps[k]`. Returns the events (client, start version, staleness), in order, the final model, and each
    version's log: (its starts (client, start time), its events, the clock at its step)."""
    profiles = [profile(k) for k in range(N)]
    heap, t, events, log = [], 0.0, [], []
    for v in range(versions):
        started, taken, arrived, p = set(), [], False, 0
        log.append(([], [], None))
        while True:
            due = heap[0][0] if heap else np.inf
            if len(heap) < C and (p == 0 if refill == "step" else due > t):
                flying = {k for _, k, _, _ in heap} | started
                online = {k for k in range(N) if not duty or (t + profiles[k][2]) % PERIOD < DUTY * PERIOD}
                u = streams.uniform(streams.stream_key(SEED, streams.SAMPLE, np.array([0]), v + (p << 32), 0), N)[0]
                free = [int(k) for k in np.argsort(u, kind="stable")
                        if int(k) not in flying and int(k) in online][:C - len(heap)]
                for k in free:
                    step_s, mb_per_s, _ = profiles[k]
                    moved = (1 - (1 - LR) ** steps[k]) * (e[k] - x)  # steps[k] steps of GD with lr LR
                    sent = x + moved if mode == "fedasync" else moved
                    heapq.heappush(heap, (t + (2 * DIM * 8 / (mb_per_s * 1e6) + steps[k] * step_s), k, v, sent))
                    started.add(k)
                    log[v][0].append((k, t))
            if not heap:
                t += 0.0 if arrived else 60.0  # nothing arrived: the server waited retry_s
                break
            t, k, start, sent = heapq.heappop(heap)
            events.append((k, start, v - start))
            log[v][1].append((k, start, v - start))
            arrived, p = True, p + 1
            if max_staleness is None or v - start <= max_staleness:
                taken.append(((1 + v - start) ** -exponent, sent))
                if len(taken) == M:
                    break
        log[v] = (*log[v][:2], t)
        if mode == "fedasync":
            for s, sent in taken:
                a = alpha * s
                x = (1 - a) * x + a * sent
        else:
            x = x + sum(1 / C * (C / M) * s * sent for s, sent in taken)  # yang_s2 draws C: q = 1/C
    return events, x, log


def recorded_run(settings, monkeypatch):
    """The run's events (client, start version, staleness) in the order its versions took them, its initial and
    final model, and each version's log as simulate's: (its starts (client, start time), its events, the clock at
    its step), of replica 0."""
    run = prepare_run(settings)
    engine = build_engine(run, InlineExecutor(run.problem, run.algorithm.solver, 1))
    events, log = [], []
    run_version, refill = flight_module.run_version, flight_module._refill

    def recording(*args, **kwargs):
        log.append(([], [], None))
        version = run_version(*args, **kwargs)
        events.extend(version.events[0])
        log[-1] = (log[-1][0], version.events[0], float(version.t[0]))
        return version

    def recording_refill(flight, v, p, rule, out, *args):
        before, t = len(out.started[0]), float(out.t[0])
        refill(flight, v, p, rule, out, *args)
        log[-1][0].extend((k, t) for k, _, _ in out.started[0][before:])

    monkeypatch.setattr(flight_module, "run_version", recording)
    monkeypatch.setattr(flight_module, "_refill", recording_refill)
    x0 = engine.initial_state().x.double().numpy()[0]
    outcome = engine.run()
    return run, x0, events, outcome.state.x.double().numpy()[0], log


@pytest.mark.parametrize("mode,C,M,max_staleness,duty,refill", [
    ("fedbuff", 8, 3, 2, False, "arrival"), ("fedbuff", 6, 2, None, False, "arrival"),
    ("fedasync", 5, 1, 3, False, "arrival"), ("fedbuff", 6, 2, 2, True, "arrival"),
    ("fedasync", 4, 1, None, True, "arrival"), ("fedbuff", 8, 3, 2, False, "step"),
    ("fedbuff", 6, 2, 2, True, "step")])
def test_fedbuff_and_fedasync_follow_an_event_driven_simulation(mode, C, M, max_staleness, duty, refill, monkeypatch,
                                                                tmp_path):
    versions, alpha, exponent = 25, 0.6, 0.5
    availability = ["availability=duty_cycle", f"availability.duty_cycle={DUTY}", f"availability.period_s={PERIOD}"]
    settings = load_settings(quadratic(
        f"rounds={versions}", f"results_dir={tmp_path}", *LOGNORMAL, f"cadence={mode}",
        f"cadence.concurrency={C}", f"cadence.refill={refill}",
        *([f"cadence.alpha={alpha}"] if mode == "fedasync" else [f"cadence.buffer={M}"]),
        f"cadence.max_staleness={'null' if max_staleness is None else max_staleness}",
        f"staleness.exponent={exponent}", *(availability if duty else [])))
    run, x0, events, final, got = recorded_run(settings, monkeypatch)
    want, x, log = simulate(run.problem.e_np, x0, versions, mode, C, M, max_staleness, alpha, exponent, duty, refill)
    assert events == want
    assert_same_log(got, log)
    if not duty:  # all online: version 0 fills the C slots; refill=arrival also refills the slots freed by its
        # first M - 1 arrivals (no two arrive together under lognormal profiles), refill=step only at the start
        assert len(got[0][0]) == C + (M - 1 if refill == "arrival" else 0)
    assert max(s for *_, s in events) >= 2  # updates were stale
    if max_staleness is not None:
        assert any(s > max_staleness for *_, s in events)  # and some too stale: dropped
    other = {"arrival": "step", "step": "arrival"}[refill]
    if mode == "fedbuff":  # the two refill rules give different runs here (with M = 1 they seldom differ)
        alternative, _, _ = simulate(run.problem.e_np, x0, versions, mode, C, M, max_staleness, alpha, exponent, duty,
                                  other)
        assert alternative != want
    np.testing.assert_allclose(final, x, rtol=1e-12, atol=1e-12 * np.abs(x).max())
    assert np.abs(final - x0).max() > 1e-3  # the model moved


def assert_same_log(got: list, want: list) -> None:
    """Each version's starts (client, time), events and step time, as recorded_run and simulate give them. The
    clients are exact; a time is a chain of at most 200 float64 sums of round times on each side, so the two
    differ by at most 2 x 200 x 2^-53 < 1e-13 of it (rtol 1e-12)."""
    assert [([k for k, _ in starts], events) for starts, events, _ in got] == \
        [([k for k, _ in starts], events) for starts, events, _ in want]
    times = lambda log: [t for starts, _, step in log for t in (*(t for _, t in starts), step)]  # noqa: E731
    np.testing.assert_allclose(times(got), times(want), rtol=1e-12)


def equal_profile(client: int) -> tuple[float, float, float]:
    """speed=equal: every client has the network's step time and bandwidth (and phase 0)."""
    return STEP_S, MB_PER_S, 0.0


@pytest.mark.parametrize("refill", ["step", "arrival"])
def test_simultaneous_arrivals_follow_the_tie_rule_of_each_refill(refill, monkeypatch, tmp_path):
    """Equal profiles and equal local work (3 steps): the clients that start together arrive together, d = 7.8 s
    later. C = 6, M = 4: version 0's step takes 4 of the 6 that arrive at d and leaves 2 due at d.
    refill=step starts clients in the 4 freed slots at version 1's start, before it takes those 2 (FedScale: the
    step starts its clients); refill=arrival takes arrivals at one instant first, then fills all 6 slots."""
    C, M, versions, steps = 6, 4, 8, [3] * N
    settings = load_settings(quadratic(
        f"rounds={versions}", f"results_dir={tmp_path}", "cadence=fedbuff", f"cadence.concurrency={C}",
        f"cadence.buffer={M}", f"cadence.refill={refill}", f"algorithm.client_steps=[{','.join(map(str, steps))}]"))
    run, x0, _, final, got = recorded_run(settings, monkeypatch)
    _, x, want = simulate(run.problem.e_np, x0, versions, "fedbuff", C, M, None, 0.6, 0.5, False, refill,
                          equal_profile, steps)
    assert_same_log(got, want)
    d = 2 * DIM * 8 / (MB_PER_S * 1e6) + 3 * STEP_S
    (starts0, events0, t0), (starts1, events1, t1) = got[:2]
    assert [t for _, t in starts0] == [0.0] * C and [s for _, s, _ in events0] == [0] * M
    assert [s for _, s, _ in events1] == [0, 0, 1, 1]  # the 2 left due at d, then 2 of version 1's at 2d
    np.testing.assert_allclose([t0, t1], [d, 2 * d], rtol=1e-15)  # d + d: one rounding
    assert [t for _, t in starts1] == [t0] * (M if refill == "step" else C)
    np.testing.assert_allclose(final, x, rtol=1e-12, atol=1e-12 * np.abs(x).max())


def test_staleness_functions_are_fedasyncs_and_fedbuffs():
    tau = np.arange(8)
    rule = PolyStaleness(0.5)
    np.testing.assert_allclose(rule.weight(tau), 1 / np.sqrt(1 + tau), rtol=1e-15)  # FedBuff's (FedScale's)
    hinge = HingeStaleness(0.5, 3)
    np.testing.assert_allclose(hinge.weight(tau), [1, 1, 1, 1, 1 / 1.5, 1 / 2, 1 / 2.5, 1 / 3], rtol=1e-15)
    constant = ConstantStaleness()
    assert (constant.weight(tau) == 1).all()


# --- c: bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key,allowed", [
    (["cadence=fedbuff", "cadence.concurrency=13"], "'cadence.concurrency': 13", "at most the 12 clients"),
    (["cadence=fedbuff", "cadence.concurrency=4", "cadence.buffer=5"], "'cadence.buffer': 5", "at most"),
    (["cadence=fedbuff", "cadence.max_staleness=-1"], "'cadence.max_staleness': -1", ">= 0"),
    (["cadence=fedasync", "cadence.alpha=0"], "'cadence.alpha': 0", "(0, 1]"),
    (["cadence=fedasync", "cadence.alpha=1.5"], "'cadence.alpha': 1.5", "(0, 1]"),
    (["cadence=fedbuff", "cadence.deadline_s=30"], "'cadence.deadline_s': '30'", "no such key; keys of 'cadence'"),
    (["systems.mode=fedbuff"], "'systems.mode': 'fedbuff'", "it is now cadence=NAME"),  # the old spelling
    (["cadence=fedbuff", "algorithm.sampler=yang_s1"], "'algorithm.sampler': 'yang_s1'", "without"),
    (["cadence=fedasync", "attack=sign_flip", "algorithm.aggregator=mean"], "'stages': ['Adversary']",
     "(compression)"),
])
def test_bad_async_input_one_message_exit_2_no_files(overrides, key, allowed, tmp_path, capsys):
    results = tmp_path / "results"
    assert main(["run", f"results_dir={results}", *quadratic("rounds=2"), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedharness: error: invalid value for "), err
    assert key in err[0] and allowed in err[0], err[0]
    assert not results.exists()


def test_updates_in_flight_beyond_the_memory_budget_are_refused(tmp_path, capsys):
    results = tmp_path / "results"
    # 12 clients x 3 floats x 8 bytes x 2 replicas = 576 bytes in flight; the budget, 300, trains one copy (240)
    assert main(["run", f"results_dir={results}", *quadratic("rounds=2", "replicas=2", "memory_budget_gb=3e-7"),
                 "cadence=fedbuff", "cadence.concurrency=12", "cadence.buffer=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'cadence.concurrency': 12" in err[0] and "memory_budget_gb" in err[0], err
    assert not results.exists()


# --- d: the same bits on shards, in a batch of seeds, resumed mid-flight ----------------------------------------

WORLD = [*LOGNORMAL, "cadence=fedbuff", "cadence.concurrency=6", "cadence.buffer=2", "cadence.max_staleness=3",
         "dataset.data_seed=0", "replicas=2", "rounds=30", "eval_every=10"]


def world_rows(tmp_path, run_id: str, *extra: str, callbacks=()) -> list[tuple]:
    return systems_world_rows(tmp_path, run_id, *extra, callbacks=callbacks, world=WORLD)


@pytest.mark.parametrize("compress", [[], TOPK])
def test_fedbuff_gives_the_same_rows_on_shards_in_a_batch_and_resumed_with_updates_in_flight(compress, tmp_path):
    alone = world_rows(tmp_path, "alone", *compress)
    assert len(alone) == 8 and all(r[-1] <= 2 for r in alone)  # M = 2 a step
    assert world_rows(tmp_path, "three", "num_shards=3", *compress) == alone
    assert world_rows(tmp_path, "loop", "executor=loop", *compress) == alone  # one client at a time, plain autograd

    world_rows(tmp_path, "resumed", "checkpoint_every=5", *compress, callbacks=[StopAt(17)])
    settings = load_settings(quadratic(f"results_dir={tmp_path}", *WORLD, "checkpoint_every=5", "resume=resumed",
                                       *compress))
    saved = load_resume(settings).state
    assert saved.round == 15 and ((saved.in_flight["client"] >= 0).sum(axis=1) >= 2).all()  # still in flight
    assert execute(settings).status == "ok"
    assert rows(tmp_path, "resumed") == alone

    def slot(seed: int) -> Slot:
        return Slot(load_settings(quadratic(f"results_dir={tmp_path}", *WORLD, "replicas=1", f"seed={seed}",
                                            *compress)), f"batch-{seed}")

    assert [r.status for r in execute_batch([slot(SEED), slot(SEED + 1)])] == ["ok", "ok"]
    assert rows(tmp_path, f"batch-{SEED}") == [r for r in alone if r[0] == 0]
    solo = world_rows(tmp_path, "solo-next", "replicas=1", f"seed={SEED + 1}", *compress)
    assert rows(tmp_path, f"batch-{SEED + 1}") == solo != [r for r in alone if r[0] == 0]


@pytest.mark.slow  # CI: Ray's start-up
def test_fedbuff_gives_the_inline_rows_on_ray(local_ray, tmp_path):
    inline = world_rows(tmp_path, "inline")
    assert world_rows(tmp_path, "ray2", "executor=ray", "ray.num_shards=2") == inline
    assert world_rows(tmp_path, "ray3", "executor=ray", "ray.num_shards=3") == inline
