"""Clients that are slow and absent (harness/core/clock.py, algorithms/systems.py): systems profiles, deadlines
and over-selection on the simulated clock, checked against a client-by-client simulation written here."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pyarrow.dataset as ds
import pytest

from fedharness.base import streams
from fedharness.cli import main
from fedharness.config.load import load_settings
from fedharness.core.executors import InlineExecutor
from fedharness.contracts import Callback
from fedharness.runs.batch import Slot
from fedharness.runs.execute import build_engine, execute, execute_batch, prepare_run

N, K, DIM, LR, SEED = 12, 4, 3, 0.1, 3
STEPS = [1, 2, 3, 5, 8, 13, 2, 4, 6, 7, 9, 11]  # each client's fixed tau_i (local_work=per_client)
MB_PER_S, STEP_S, SIGMA, BW_SIGMA = 1e-5, 1.0, 0.8, 0.5  # 48 bytes a round: about 4.8 s of transfer
DUTY, PERIOD = 0.7, 30.0
ROUND_COLUMNS = ["replica", "round", "train_loss", "dist_to_opt", "local_steps", "grad_evals", "bytes_up",
                 "bytes_down", "sim_s", "participants"]


def quadratic(*extra: str) -> list[str]:
    return ["dataset=quadratic", f"dataset.num_clients={N}", f"dataset.dim={DIM}", "dataset.curvature=identity",
            "dtype=float64", "algorithm.sampler=yang_s2", f"algorithm.clients_per_round={K}",
            "algorithm.local_work=per_client", f"algorithm.client_steps=[{','.join(map(str, STEPS))}]",
            f"algorithm.client_lr={LR}", f"seed={SEED}", "progress=false", "reference=off",
            f"network.bandwidth_MB_per_s={MB_PER_S}", f"network.compute_s_per_step={STEP_S}", *extra]


def rows(results_dir, run_id: str) -> list[tuple]:
    table = ds.dataset(results_dir / "rounds" / f"run_id={run_id}", format="parquet").to_table(columns=ROUND_COLUMNS)
    return sorted(tuple(r[c] for c in ROUND_COLUMNS) for r in table.to_pylist())


def test_equal_profiles_always_online_and_no_deadline_give_todays_run_bit_for_bit(tmp_path):
    runs = {"today": [], "equal": ["speed=lognormal", "speed.step_sigma=0", "speed.bandwidth_sigma=0",
                                   "availability=duty_cycle", "availability.duty_cycle=1.0"]}
    got = {}
    for name, extra in runs.items():
        settings = load_settings(quadratic("rounds=6", f"results_dir={tmp_path}", *extra))
        assert execute(settings, run_id=name).status == "ok"
        got[name] = rows(tmp_path, name)
    assert got["equal"] == got["today"]
    assert got["today"][-1][-2] > 0 and got["today"][-1][-1] == K  # the clock ran; K clients took part


def test_an_uplink_of_its_own_times_the_upload_with_the_section_off_as_on(tmp_path):
    slow_up = [f"network.upload_MB_per_s={MB_PER_S / 100}", "rounds=2", f"results_dir={tmp_path}"]
    for name, extra in (("off", []), ("on", ["speed=lognormal", "speed.step_sigma=0",
                                             "speed.bandwidth_sigma=0"])):
        assert execute(load_settings(quadratic(*slow_up, *extra)), run_id=name).status == "ok"
    off, on = rows(tmp_path, "off"), rows(tmp_path, "on")
    assert off == on
    # each round: 24 bytes down at 10 B/s, 24 up at 0.1 B/s, and its longest local work (local_steps) at 1 s a step
    local_steps, sim_s = off[-1][4], off[-1][8]
    assert sim_s == pytest.approx(2 * (2.4 + 240.0) + STEP_S * local_steps, rel=1e-12)


# --- the client-by-client simulation -----------------------------------------------------------------------------

def client_profile(client: int) -> tuple[float, float, float]:
    """(step s, MB/s, phase s) of a client, from its documented streams (algorithms/systems.py)."""
    key = streams.stream_key(SEED, streams.SYSTEMS, 0, 0, client)
    z = streams.normal(np.array([key]), 2)[0]
    phase = streams.uniform(np.array([streams.stream_key(SEED, streams.SYSTEMS, 0, 1, client)]), 1)[0, 0] * PERIOD
    return STEP_S * math.exp(SIGMA * z[0]), MB_PER_S * math.exp(BW_SIGMA * z[1]), phase


def simulate(e: np.ndarray, x: np.ndarray, rounds: int, deadline: float, keep_first: int, sampled: int,
             partial: bool, nova: bool):
    """FedAvg / FedNova on F_i = 1/2 ||x - e_i||^2 with local GD, client by client: per round the kept clients
    with their steps, the round's length and how many clients downloaded the model; the final model."""
    profiles = [client_profile(k) for k in range(N)]
    t, log = 0.0, []
    for rnd in range(rounds):
        u = streams.uniform(streams.stream_key(SEED, streams.SAMPLE, np.array([0]), rnd, 0), N)[0]
        order = list(np.argsort(u, kind="stable"))
        online = {k: (t + profiles[k][2]) % PERIOD < DUTY * PERIOD for k in range(N)}
        picked = ([k for k in order if online[k]] + [k for k in order if not online[k]])[:sampled]
        finished = []  # (finish time, position, client, steps)
        for pos, k in enumerate(picked):
            step_s, mb_per_s, _ = profiles[k]
            comm = 2 * DIM * 8 / (mb_per_s * 1e6)
            steps = STEPS[k]
            if partial:
                n = 0
                while n < steps and comm + (n + 1) * step_s <= deadline:
                    n += 1
                steps = n
            finish = comm + steps * step_s
            if online[k] and steps >= 1 and finish <= deadline:
                finished.append((finish, pos, k, steps))
        kept = sorted(finished)[:keep_first]
        reached = sum(online[k] for k in picked)  # every online client sampled downloads the model
        log.append((sorted((k, s) for _, _, k, s in kept), max([f for f, *_ in kept], default=deadline), reached))
        if kept:
            q = 1.0 / len(kept)  # yang_s2's 1/K', rescaled to the selection's total
            deltas = {k: (1 - (1 - LR) ** s) * (e[k] - x) for _, _, k, s in kept}
            if nova:
                tau_eff = sum(q * s for _, _, _, s in kept)
                x = x + sum(q * tau_eff / s * deltas[k] for _, _, k, s in kept)
            else:
                x = x + sum(q * deltas[k] for _, _, k, _ in kept)
        t += log[-1][1]
    return log, x


@pytest.mark.parametrize("aggregator,late_work,deadline,over", [("fednova", "partial", 14.0, 1.5),
                                                                 ("fedavg", "drop", 16.0, 1.5),
                                                                 ("fedavg", "drop", 9.0, 1.0)])
def test_deadline_and_over_selection_keep_the_clients_a_client_by_client_simulation_keeps(
        aggregator, late_work, deadline, over, tmp_path):
    rounds = 12
    settings = load_settings(quadratic(
        f"rounds={rounds}", f"results_dir={tmp_path}", f"algorithm.aggregator={aggregator}",
        "speed=lognormal", f"speed.step_sigma={SIGMA}", f"speed.bandwidth_sigma={BW_SIGMA}",
        "availability=duty_cycle", f"availability.duty_cycle={DUTY}", f"availability.period_s={PERIOD}",
        f"cadence.deadline_s={deadline}", f"cadence.over_selection={over}", f"cadence.late_work={late_work}"))
    run = prepare_run(settings)
    engine = build_engine(run, InlineExecutor(run.problem, run.algorithm.solver, 1))
    plans, lengths = [], []
    plan_round = engine.plan_round

    def recorded(rnd, clock=None):
        plan, coefs = plan_round(rnd, clock)
        plans.append(plan)
        lengths.append(float(engine._sim_seconds[0]))
        return plan, coefs

    engine.plan_round = recorded
    x0 = engine.initial_state().x.double().numpy()[0]
    outcome = engine.run()
    e = run.problem.e_np
    log, x = simulate(e, x0, rounds, deadline, K, math.ceil(over * K), late_work == "partial",
                      aggregator == "fednova")
    for rnd, (plan, (kept, length, _)) in enumerate(zip(plans, log)):
        trained = plan.coef[0] != 0
        assert sorted(zip(plan.clients[0][trained].tolist(), plan.tau[0][trained].tolist())) == kept, rnd
        assert lengths[rnd] == length, rnd
    assert any(len(k) < math.ceil(over * K) for k, *_ in log)  # the deadline or over-selection removed someone
    if late_work == "partial":
        assert any(s < STEPS[k] for kept, *_ in log for k, s in kept)  # someone sent partial work
    counters = outcome.state.counters  # 24 bytes each way: the model reached more clients than it heard from
    # exact: byte counts (integers)
    assert counters["bytes_down"][0] == 24 * sum(r for *_, r in log) > counters["bytes_up"][0] == 24 * sum(
        len(k) for k, *_ in log)
    final = outcome.state.x.double().numpy()[0]
    np.testing.assert_allclose(final, x, rtol=1e-12, atol=1e-12 * np.abs(x).max())


def test_a_round_nobody_takes_part_in_moves_nothing_and_says_so(tmp_path):
    settings = load_settings(quadratic("rounds=8", f"results_dir={tmp_path}", "eval_every=1",
                                       "availability=duty_cycle", "availability.duty_cycle=0.05",
                                       "availability.period_s=1000", "cadence.retry_s=7.5"))
    assert execute(settings, run_id="r").status == "ok"
    table = sorted(ds.dataset(tmp_path / "rounds" / "run_id=r", format="parquet").to_table().to_pylist(),
                   key=lambda r: r["round"])
    empty = [(a, b) for a, b in zip(table, table[1:]) if b["participants"] == 0]
    assert empty, [r["participants"] for r in table]
    for before, after in empty:
        assert after["train_loss"] == before["train_loss"] and after["local_steps"] == before["local_steps"]
        assert after["sim_s"] == before["sim_s"] + 7.5


@pytest.mark.parametrize("overrides,key,allowed", [
    (["cadence.over_selection=0.9"], "'cadence.over_selection': 0.9", ">= 1"),
    (["cadence.deadline_s=1.0"], "'cadence.deadline_s': 1.0", "fastest client's transfer"),
    (["cadence.deadline_s=1.0", "speed=slow_tail"], "'cadence.deadline_s': 1.0", "fastest client's"),
    (["cadence.over_selection=1.5", "algorithm.sampler=yang_s1"], "'cadence.over_selection': 1.5", "without"),
    (["cadence.over_selection=4"], "'cadence.over_selection': 4", "at most N / K"),
    (["speed=trace"], "'speed.file': None", "a file"),
])
def test_bad_systems_input_one_message_exit_2_no_files(overrides, key, allowed, tmp_path, capsys):
    results = tmp_path / "results"
    assert main(["run", f"results_dir={results}", *quadratic("rounds=2"), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedharness: error: invalid value for "), err
    assert key in err[0] and allowed in err[0], err[0]
    assert not results.exists()


# --- the same bits everywhere ---------------------------------------------------------------------------------

WORLD = ["algorithm.aggregator=fednova", "dataset.data_seed=0", "replicas=2", "rounds=30", "eval_every=10", "speed=lognormal",
         f"speed.step_sigma={SIGMA}", "availability=duty_cycle", f"availability.duty_cycle={DUTY}",
         f"availability.period_s={PERIOD}", "cadence.deadline_s=10.0", "cadence.over_selection=1.5",
         "cadence.late_work=partial"]


class StopAt(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_round_end(self, context):
        return context.round == self.at


def world_rows(tmp_path, run_id: str, *extra: str, callbacks=(), world=WORLD) -> list[tuple]:
    """The rows of a run of `world` (with `extra`) on the quadratic; stopped by `callbacks`, else ok."""
    settings = load_settings(quadratic(f"results_dir={tmp_path}", *world, *extra))
    assert execute(settings, run_id=run_id, callbacks=list(callbacks)).status == ("stopped" if callbacks else "ok")
    return rows(tmp_path, run_id)


def resumed_rows(tmp_path, world: list[str], stop_at: int) -> list[tuple]:
    """The rows of `world` stopped after round `stop_at`, then resumed from its last checkpoint (every 5 rounds)."""
    world_rows(tmp_path, "resumed", "checkpoint_every=5", callbacks=[StopAt(stop_at)], world=world)
    settings = load_settings(quadratic(f"results_dir={tmp_path}", *world, "checkpoint_every=5", "resume=resumed"))
    assert execute(settings).status == "ok"
    return rows(tmp_path, "resumed")


def batch_rows(tmp_path, world: list[str]) -> tuple[list[tuple], list[tuple]]:
    """The rows of `world` with seeds SEED and SEED + 1 (one replica each) run as one batch of two slots."""

    def slot(seed: int) -> Slot:
        return Slot(load_settings(quadratic(f"results_dir={tmp_path}", *world, "replicas=1", f"seed={seed}")),
                    f"batch-{seed}")

    assert [r.status for r in execute_batch([slot(SEED), slot(SEED + 1)])] == ["ok", "ok"]
    return rows(tmp_path, f"batch-{SEED}"), rows(tmp_path, f"batch-{SEED + 1}")


def test_profiles_deadline_and_over_selection_give_the_same_rows_on_shards_in_a_batch_and_resumed(tmp_path):
    alone = world_rows(tmp_path, "alone")
    assert len(alone) == 8 and any(r[-1] < K for r in alone[1:])  # 2 replicas x 4 evaluations; someone missed out
    assert world_rows(tmp_path, "three", "num_shards=3") == alone

    assert resumed_rows(tmp_path, WORLD, 17) == alone
    first, second = batch_rows(tmp_path, WORLD)
    replica0 = [r for r in alone if r[0] == 0]
    assert first == replica0
    solo = world_rows(tmp_path, "solo-next", "replicas=1", f"seed={SEED + 1}")
    assert second == solo != replica0


@pytest.mark.slow  # CI: Ray's start-up
def test_profiles_deadline_and_over_selection_give_the_inline_rows_on_ray(local_ray, tmp_path):
    inline = world_rows(tmp_path, "inline")
    assert world_rows(tmp_path, "ray2", "executor=ray", "ray.num_shards=2") == inline
    assert world_rows(tmp_path, "ray3", "executor=ray", "ray.num_shards=3") == inline


# --- FedScale traces ------------------------------------------------------------------------------------------

def write_traces(folder) -> tuple[str, str]:
    """A device and an availability trace in FedScale's layout (pickles of plain dicts)."""
    devices = {7: {"computation": 500.0, "communication": 80.0}, 11: {"computation": 2000.0, "communication": 40.0},
               3: {"computation": 50.0, "communication": 160.0}}
    behave = {7: {"active": [0.0, 50.0], "inactive": [30.0, 90.0], "finish_time": 100.0, "duration": 100.0},
              11: {"active": [10.0], "inactive": [60.0], "finish_time": 100.0},
              3: {"active": [], "inactive": [], "finish_time": 100.0}}
    paths = folder / "device.pkl", folder / "behave.pkl"
    for path, trace in zip(paths, (devices, behave)):
        path.write_bytes(pickle.dumps(trace))
    return str(paths[0]), str(paths[1])


def test_a_run_on_fedscale_traces_keeps_only_online_clients_in_time(tmp_path):
    device, behave = write_traces(tmp_path)
    settings = load_settings(quadratic(f"results_dir={tmp_path / 'r'}", "rounds=12", "eval_every=1",
                                       "speed=trace", f"speed.file={device}",
                                       "speed.samples_per_step=10", "availability=trace",
                                       f"availability.file={behave}", "cadence.deadline_s=25"))
    assert execute(settings, run_id="t").status == "ok"
    table = sorted(ds.dataset(tmp_path / "r" / "rounds", format="parquet").to_table().to_pylist(),
                   key=lambda r: r["round"])
    seconds = np.diff([r["sim_s"] for r in table])
    # entries in id order 3, 7, 11: 50, 500, 2000 ms a sample (10 a step), 160, 80, 40 kbit/s; client k reads entry
    # floor(u M) of its own stream (algorithms/systems.py). A round lasts its slowest kept client's transfer of 48
    # bytes plus its tau_k steps, each client's finishing time within the deadline
    ms, kbit = np.array([50.0, 500.0, 2000.0]), np.array([160.0, 80.0, 40.0])
    entry = [int(streams.uniform(np.array([streams.stream_key(SEED, streams.SYSTEMS, 0, 2, k)]), 1)[0, 0] * 3)
             for k in range(N)]
    finish = {k: 48 / (kbit[entry[k]] / 8000 * 1e6) + STEPS[k] * ms[entry[k]] * 10 / 1000 for k in range(N)}
    in_time = np.array(sorted({f for f in finish.values() if f <= 25.0}))
    for s, r in zip(seconds, table[1:]):  # s is a difference of the cumulative sim_s: equal to 1e-12 relative
        assert np.isclose(in_time, s, rtol=1e-12, atol=0).any() if r["participants"] else s == 25.0, (s, in_time)
    assert any(r["participants"] > 0 for r in table[1:]) and len(in_time) < N


def test_bad_trace_files_one_message_exit_2_no_files(tmp_path, capsys):
    device, behave = write_traces(tmp_path)
    broken = tmp_path / "broken.pkl"
    broken.write_bytes(pickle.dumps({1: {"active": [9.0], "inactive": [5.0], "finish_time": 100.0}}))
    numpy_inside = tmp_path / "numpy.pkl"  # an array: a global the reader refuses (numpy numbers it reads)
    numpy_inside.write_bytes(pickle.dumps({1: {"active": np.array([1.0]), "inactive": [5.0], "finish_time": 9.0}}))
    cases = [([f"availability.file={broken}"], "'availability.file'", "ends (5.0) before it starts"),
             ([f"availability.file={device}"], "'availability.file'", "no 'finish_time' key"),
             ([f"availability.file={tmp_path / 'nope.pkl'}"], "'availability.file'", "not found"),
             ([f"availability.file={numpy_inside}"], "'availability.file'", "multiarray._reconstruct")]
    for overrides, key, allowed in cases:
        results = tmp_path / "results"
        assert main(["run", f"results_dir={results}", *quadratic("rounds=2"), "availability=trace",
                     *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and key in err[0] and allowed in err[0], err
        assert not results.exists()
    # a deadline below the fastest entry's transfer: 48 bytes at 20 kB/s is 2.4 ms
    assert main(["run", f"results_dir={tmp_path / 'results'}", *quadratic("rounds=2"), "speed=trace",
                 f"speed.file={device}", "cadence.deadline_s=0.002"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'cadence.deadline_s': 0.002" in err and "0.0024 s" in err
    assert not (tmp_path / "results").exists()


def test_tabled_profiles_draw_the_numbers_each_client_draws_alone():
    """Populations up to TABLE_MAX_CLIENTS table their draws per (seed, replica): the same numbers as drawing
    each client on demand (as 10^8 clients do)."""
    from fedharness.algorithms.systems import DutyCycle, EqualSpeeds, LognormalSpeeds, SlowTailSpeeds

    base = EqualSpeeds(0.5, 2.0, 1.0)
    seeds, replicas = np.array([3, 3, 4]), np.array([0, 1, 0])
    clients = np.random.default_rng(0).integers(0, 50, (3, 7))
    t = np.array([0.0, 17.0, 33.0])
    for make in (lambda n: LognormalSpeeds(base, 0.7, 0.4, n), lambda n: SlowTailSpeeds(base, 0.3, 8.0, n)):
        tabled, alone = make(50).links(seeds, replicas, clients), make(None).links(seeds, replicas, clients)
        for name in ("step_s", "down_MB_per_s", "up_MB_per_s"):
            assert np.array_equal(getattr(tabled, name), getattr(alone, name)), name
        assert len(np.unique(tabled.step_s)) >= 2  # clients differ
    on = DutyCycle(0.4, 30.0, 50).online(seeds, replicas, t, clients)
    assert np.array_equal(on, DutyCycle(0.4, 30.0).online(seeds, replicas, t, clients)) and 0 < on.mean() < 1
