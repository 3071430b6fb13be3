"""Byzantine attacks (algorithms/attacks.py, algorithms/byzantine.py): each attack against an independent numpy version on
captured honest updates, the Byzantine set at any shard split, Ray against inline, bad input, a user's attack."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.core.config_store import ConfigStore
from scipy.stats import norm

import fedharness
from fedharness.algorithms.attacks import ALittleIsEnough, GaussianNoise, InnerProductManipulation, Scaling, SignFlip
from fedharness.assembly.build import adversary_for, build_parts
from fedharness.base import streams
from fedharness.algorithms.byzantine import Adversary, byzantine_mask, forge_updates
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.core.stages import Stages
from fedharness.registry.groups import ATTACKS
from ray_support import trajectory

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

# 12 clients, 10 drawn without replacement a round: 10 distinct clients, so floor(0.2 * 10) = 2 are Byzantine.
BASE = ["dataset.num_clients=12", "dataset.samples_per_client=30", "dtype=float64", "replicas=2",
        "algorithm.batch_size=10", "algorithm.local_steps=3", "algorithm.clients_per_round=10",
        "algorithm.sampler=scheme_ii", "algorithm.client_lr=0.1", "heterogeneity=false", "seed=3",
        "algorithm=fedavg_median"]
ATTACK_NAMES = ("sign_flip", "gaussian", "scaling", "alie", "ipm")


def captured(run_config, shards: int = 1, *overrides: str):
    """Round 0's plan and the honest updates the shards send (a copy of each replica's rows, by client id)."""
    cfg = run_config(*BASE, "attack=sign_flip", *overrides)
    problem, algorithm = build_parts(cfg)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, shards), rounds=1, seed=cfg.seed,
                    replicas=cfg.replicas, eval_every=1)
    state = engine.initial_state()
    plan, _ = engine.plan_round(0)
    chunks = engine.executor.local_updates(state.x, plan).updates
    return cfg, plan, chunks


def rows_of(plan, chunks, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Replica r's client ids and their updates [n, dim] float64, in client order."""
    ids, _ = plan.returned(r)
    where = {(int(rr), int(k)): c.delta[i] for c in chunks for i, (rr, k) in enumerate(zip(c.replica, c.clients))}
    return ids, np.stack([where[(r, int(k))].double().numpy() for k in ids])


def numpy_attack(name: str, own: np.ndarray, honest: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """What the papers say each Byzantine client sends, written with numpy and scipy only."""
    b, n = len(own), len(own) + len(honest)
    if name == "sign_flip":
        return -own
    if name == "scaling":
        return 10.0 * own
    if name == "ipm":
        return np.tile(-0.1 * honest.mean(0), (b, 1))
    if name == "alie":
        s = math.floor(n / 2 + 1) - b  # Baruch et al.: the clients to win over
        z = norm.ppf((n - s) / n)
        return np.tile(honest.mean(0) - z * honest.std(0, ddof=1), (b, 1))
    # gaussian: Box-Muller on the stream's uniforms, N(0, 1) a coordinate
    u = streams.uniform(keys, 2 * own.shape[1])
    d = own.shape[1]
    return np.sqrt(-2 * np.log(1 - u[:, :d])) * np.cos(2 * np.pi * u[:, d:])


@pytest.mark.parametrize("name", ATTACK_NAMES)
def test_each_attack_equals_numpy_on_captured_honest_updates(run_config, name):
    cfg, plan, chunks = captured(run_config)
    honest = {r: rows_of(plan, chunks, r) for r in range(cfg.replicas)}
    attack = ATTACKS.build(name, run_config(*BASE, f"attack={name}").attack.as_dict(), {})
    forge_updates(Adversary(attack, 0.2), plan, chunks)
    for r in range(cfg.replicas):
        ids, before = honest[r]
        _, after = rows_of(plan, chunks, r)
        bad = byzantine_mask(0.2, cfg.seed, r, 0, ids)
        assert bad.sum() == 2 and len(ids) == 10
        assert np.array_equal(after[~bad], before[~bad])  # honest rows untouched
        keys = streams.stream_key(cfg.seed, streams.ATTACK_NOISE, r, 0, ids[bad])
        want = numpy_attack(name, before[bad], before[~bad], keys)
        assert np.abs(after[bad] - want).max() <= 1e-12 * np.abs(want).max()
        assert np.abs(after[bad] - before[bad]).max() > 1e-3 * np.abs(before).max()  # it changed them


def test_gaussian_noise_has_its_standard_deviation():
    own = torch.zeros(4, 50_000, dtype=torch.float64)
    sent = GaussianNoise(noise_std=0.3).forge(own, own, streams.stream_key(1, streams.ATTACK_NOISE, 0, 0,
                                                                           np.arange(4)))
    assert abs(sent.std().item() / 0.3 - 1) < 0.01 and abs(sent.mean().item()) < 0.01 * 0.3


def test_the_attacks_read_what_their_papers_say():
    """Closed forms on a 2-coordinate example (n = 5, b = 1: ALIE's z_max = Phi^-1(3/5) = 0.2533)."""
    honest = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 4.0], [7.0, 6.0]], dtype=torch.float64)
    own = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    keys = np.zeros(1, dtype=np.uint64)
    std = math.sqrt(20 / 3)
    assert SignFlip().forge(own, honest, keys).tolist() == [[-2.0, 1.0]]
    assert Scaling(factor=3.0).forge(own, honest, keys).tolist() == [[6.0, -3.0]]
    assert InnerProductManipulation(epsilon=0.5).forge(own, honest, keys).tolist() == [[-2.0, -1.5]]
    got = ALittleIsEnough().forge(own, honest, keys)[0].numpy()
    assert np.allclose(got, [4.0 - 0.253347 * std, 3.0 - 0.253347 * std], rtol=1e-6)
    assert np.allclose(ALittleIsEnough(z=1.0).forge(own, honest, keys)[0].numpy(), [4.0 - std, 3.0 - std])


def test_the_byzantine_set_is_the_same_at_any_shard_split(run_config):
    cfg, plan, one = captured(run_config, 1)
    _, _, three = captured(run_config, 3)
    assert len(three) > len(one)  # the updates came back in other groupings
    attack = ATTACKS.build("alie", run_config(*BASE, "attack=alie").attack.as_dict(), {})
    forge_updates(Adversary(attack, 0.2), plan, one)
    forge_updates(Adversary(attack, 0.2), plan, three)
    for r in range(cfg.replicas):
        assert np.array_equal(rows_of(plan, one, r)[1], rows_of(plan, three, r)[1])
    # the draw is a function of the keys: a client's rank among the returned ones, whoever else was drawn
    ids = np.arange(20)
    mask = byzantine_mask(0.2, 7, 0, 5, ids)
    u = streams.uniform(streams.stream_key(7, streams.BYZANTINE, 0, 5, ids), 1)[:, 0]
    assert mask.sum() == 4 and set(ids[mask]) == set(ids[np.argsort(u)[:4]])
    assert byzantine_mask(0.2, 7, 0, 5, ids[:4]).sum() == 0  # floor(0.8)
    assert byzantine_mask(0.49, 7, 0, 5, ids[:4]).sum() == 1


def test_runs_with_an_attack_give_the_same_models_with_one_or_three_shards(run_config):
    cfg = run_config(*BASE, "attack=alie")
    problem, algorithm = build_parts(cfg)
    adversary = adversary_for(cfg, algorithm, problem)

    def models(shards: int):
        engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, shards), rounds=3,
                        seed=cfg.seed, replicas=cfg.replicas, eval_every=3, stages=Stages([adversary]))
        state = engine.initial_state()
        for _ in range(3):
            state = engine.step(state)
        return state.x

    clean, _ = trajectory(cfg, InlineExecutor(problem, algorithm.solver, 1), 3, problem, algorithm)
    one, three = models(1), models(3)
    assert torch.equal(one, three)
    assert (one - clean[-1]).norm() > 1e-3 * (clean[-1] - clean[0]).norm()  # the attack moved the trajectory


@pytest.mark.parametrize("name", ["geometric_median", "centered_clip", "mean"])
def test_the_robust_rules_run_under_attack_and_record_it(run_config, tmp_path, name):
    result = fedharness.run([f"results_dir={tmp_path}", "progress=false", *BASE, f"algorithm.aggregator={name}",
                             "attack=ipm", "attack.epsilon=0.5", "rounds=2", "eval_every=1"])
    row = result.runs.loc[0]
    assert row["status"] == "ok"
    assert json.loads(row["config_json"])["attack"] == {"name": "ipm", "fraction": 0.2, "fixed": False, "epsilon": 0.5}
    assert result.rounds["train_loss"].notna().all()


# --- bad input: one line, exit 2, nothing written ------------------------------------------------------------

BAD = [
    (["algorithm=fedavg_median", "attack=sign_flip", "attack.fraction=0.5"], "attack.fraction", "[0, 0.5)"),
    (["algorithm=fedavg_median", "attack=alie", "attack.fraction=-0.1"], "attack.fraction", "[0, 1)"),
    (["attack=alie"], "algorithm.aggregator", "needs one that sees them"),
    (["attack=sign_flip", "algorithm=fednova"], "algorithm.aggregator", "needs one that sees them"),
    (["attack=none", "attack.fraction=0.1"], "attack.fraction", "0 with attack=none"),
    (["algorithm=fedavg_median", "attack=ipm", "attack.epsilon=0"], "attack.epsilon", "> 0"),
    (["dataset=quadratic", "attack=label_flip"], "attack", "class labels"),
]


@pytest.mark.parametrize("overrides,key,allowed", BAD)
def test_bad_attack_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, overrides, key, allowed):
    from fedharness.cli import main

    assert main(["run", "dataset.num_clients=12", "rounds=1", f"results_dir={tmp_path / 'r'}", *overrides]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"'{key}'" in lines[0] and allowed in lines[0], lines
    assert not (tmp_path / "r").exists()


# --- a user's attack, registered from Python ---------------------------------------------------------------

class Zero:
    """Byzantine clients that send nothing useful: zeros, times a `gain` for the key's sake."""

    def __init__(self, gain: float = 0.0):
        self.gain = gain

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        return self.gain * own


@pytest.fixture
def registered_zero():
    fedharness.register_attack("zero", Zero, fraction=0.3, gain=0.0)
    yield
    ATTACKS.pop("zero")
    del ConfigStore.instance().repo["attack"]["zero.yaml"]


def test_a_users_attack_runs_and_is_listed(registered_zero, tmp_path, capsys):
    from fedharness.cli import cmd_list

    base = [f"results_dir={tmp_path}", "progress=false", *BASE, "algorithm.aggregator=mean", "rounds=2"]
    zeroed = fedharness.run([*base, "attack=zero"]).rounds
    same = fedharness.run([*base, "attack=zero", "attack.gain=1.0"]).rounds  # sends its own update: no attack
    clean = fedharness.run(base).rounds
    pd.testing.assert_series_equal(same["train_loss"], clean["train_loss"])
    assert abs(zeroed["train_loss"].iloc[-1] - clean["train_loss"].iloc[-1]) > 1e-6
    cmd_list()
    assert re.search(r"attacks:.*\bzero\b", capsys.readouterr().out)


# --- inline against Ray: the runs, identical rows -------------------------------------------------

COMPARED = ["round", "replica", "train_loss", "test_loss", "test_acc", "grad_norm_sq", "local_steps", "bytes_up"]


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["sign_flip", "alie", "label_flip"])
def test_ray_shards_give_the_inline_rows(local_ray, tmp_path, attack):
    run = ["dataset=digits", "algorithm=fedavg_median", f"attack={attack}", "attack.fraction=0.2", "rounds=5",
           "progress=false"]
    inline = fedharness.run([*run, f"results_dir={tmp_path / 'inline'}"]).rounds
    ray = fedharness.run([*run, f"results_dir={tmp_path / 'ray'}", "executor=ray", "ray.num_shards=2"]).rounds
    clean = fedharness.run(["dataset=digits", "algorithm=fedavg_median", "rounds=5", "progress=false",
                            f"results_dir={tmp_path / 'clean'}"]).rounds
    assert len(inline) == 2 and inline[COMPARED].equals(ray[COMPARED])
    assert inline["train_loss"].iloc[-1] != clean["train_loss"].iloc[-1]  # the attack changed the run


def test_a_batch_of_seeds_under_attack_gives_each_seed_its_solo_rows(tmp_path):
    """The batched engine's slots (each replica its own seed) draw their own Byzantine clients, as alone."""
    from fedharness.config.load import load_settings
    from fedharness.runs.batch import Slot
    from fedharness.runs.execute import execute, execute_batch

    def load(where: str, seed: int):
        return load_settings([f"results_dir={tmp_path / where}", "progress=false", *BASE, "attack=alie",
                              "dataset.data_seed=0", "replicas=1", f"seed={seed}", "rounds=3", "eval_every=1"])

    for seed in (1, 2):
        execute(load("solo", seed), run_id=f"solo-{seed}")
    assert [r.status for r in execute_batch([Slot(load("batch", s), f"batch-{s}") for s in (1, 2)])] == ["ok"] * 2
    read = lambda where, run: pd.read_parquet(tmp_path / where / "rounds" / f"run_id={run}")  # noqa: E731
    for seed in (1, 2):
        solo, batch = read("solo", f"solo-{seed}"), read("batch", f"batch-{seed}")
        assert len(solo) == 4
        pd.testing.assert_frame_equal(batch[COMPARED].reset_index(drop=True), solo[COMPARED].reset_index(drop=True),
                                      rtol=1e-12)
    assert read("solo", "solo-1")["train_loss"].iloc[-1] != read("solo", "solo-2")["train_loss"].iloc[-1]


def test_a_run_continued_from_its_round_2_state_meets_the_same_byzantine_clients(run_config):
    """What --resume does: a fresh engine and executor from a saved round's state; the draws are keyed by round."""
    cfg = run_config(*BASE, "attack=ipm", "attack.epsilon=2.0")
    problem, algorithm = build_parts(cfg)

    def engine():  # each its own attack object, as a resumed process builds it
        return Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 2), rounds=4, seed=cfg.seed,
                      replicas=cfg.replicas, eval_every=4, stages=Stages([adversary_for(cfg, algorithm, problem)]))

    whole = engine()
    state = whole.initial_state()
    for _ in range(4):
        state = whole.step(state)
    first = engine()
    half = first.initial_state()
    for _ in range(2):
        half = first.step(half)
    resumed = engine()
    for _ in range(2):
        half = resumed.step(half)
    assert half.round == 4 and torch.equal(half.x, state.x)


def test_label_flip_trains_the_byzantine_clients_on_flipped_labels(run_config):
    """The Byzantine clients' updates are those of honest training on labels numpy flipped (y -> C - 1 - y); the
    others' are the clean updates; with fedavg (summed on the shards) too, on the loop executor alike."""
    import copy
    from dataclasses import replace

    from fedharness.core.executors import LoopExecutor

    cfg = run_config(*BASE, "attack=label_flip")
    problem, algorithm = build_parts(cfg)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 2), rounds=1, seed=cfg.seed,
                    replicas=cfg.replicas, eval_every=1, stages=Stages([adversary_for(cfg, algorithm, problem)]))
    state = engine.initial_state()
    plan, _ = engine.plan_round(0)
    plan.stages = engine.stages.client_work(plan, state.counters)  # what Engine.step sends the shards
    assert plan.stages[0].poisoned.sum() == 2 * cfg.replicas
    got = engine.executor.local_updates(state.x, plan).updates
    y = problem.y.numpy()
    classes = max(y.max(), problem.y_test.numpy().max()) + 1
    flipped = copy.copy(problem)
    flipped.y = torch.as_tensor(classes - 1 - y)
    clean_plan = replace(plan, stages=())
    on_flipped = InlineExecutor(flipped, algorithm.solver, 1).local_updates(state.x, clean_plan).updates
    clean = InlineExecutor(problem, algorithm.solver, 1).local_updates(state.x, clean_plan).updates
    loop = LoopExecutor(problem, algorithm.solver).local_updates(state.x, plan).updates
    for r in range(cfg.replicas):
        ids, rows = rows_of(plan, got, r)
        bad = byzantine_mask(0.2, cfg.seed, r, 0, ids)
        assert set(ids[bad]) == set(plan.clients[r][plan.stages[0].poisoned[r]])
        assert np.array_equal(rows[bad], rows_of(plan, on_flipped, r)[1][bad])
        assert np.array_equal(rows[~bad], rows_of(plan, clean, r)[1][~bad])
        assert np.abs(rows[bad] - rows_of(plan, clean, r)[1][bad]).max() > 1e-3 * np.abs(rows).max()
        assert np.abs(rows_of(plan, loop, r)[1] - rows).max() < 1e-9 * np.abs(rows).max()
    fedavg = run_config(*BASE, "attack=label_flip", "algorithm=fedavg", "algorithm.sampler=scheme_ii")
    assert adversary_for(fedavg, build_parts(fedavg)[1], problem).flips_labels  # no update-seeing rule needed
