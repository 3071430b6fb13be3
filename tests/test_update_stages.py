"""Update stages (contracts.UpdateStage, core/stages.py; docs/extending.md "Update stages"): a user's stage,
registered from Python, runs in the order of the `stages` key, the same bits inline on 1 and 3 shards, on 2 Ray
shards and in a batch of slots; what it needs is checked before the run; the stage list is refused when it leaves
out an attack or DP that the config turns on, and a DP run without Poisson sampling says what to add."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fedharness
from fedharness.cli import main
from fedharness.config.load import load_settings
from fedharness.contracts import ClientWork, UpdateStage
from fedharness.core.engine import Engine
from fedharness.assembly.build import build_parts
from fedharness.contracts import RoundPlan
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import prepare_run
from round_rows import rows, run_rows

NORM = 0.05  # below most clients' update norms on digits after 5 local steps: the stage changes the run


class ClipEach(UpdateStage):
    """Clip each client's update to `norm` in the shards (no noise): the stage docs/extending.md shows."""

    def __init__(self, norm: float = 1.0):
        self.norm = float(norm)

    def client_work(self, plan, counters) -> ClientWork:
        return ClipToNorm(self.norm)


@dataclass(frozen=True)
class ClipToNorm(ClientWork):
    norm: float

    def transform(self, delta, replica, clients):
        norms = delta.norm(dim=1, keepdim=True)
        clipped = norms > self.norm
        return delta * (self.norm / norms.clamp_min(1e-300)).clamp(max=1.0), {"clip_each_clipped": clipped[:, 0].numpy()}


class ScaleBy(UpdateStage):
    """Multiply each client's update by `factor` in the shards."""

    def __init__(self, factor: float = 1.0):
        self.factor = float(factor)

    def client_work(self, plan, counters) -> ClientWork:
        return Scale(self.factor)


@dataclass(frozen=True)
class Scale(ClientWork):
    factor: float

    def transform(self, delta, replica, clients):
        return delta * self.factor, {}


@dataclass(frozen=True)
class HalfFeedback(ClientWork):
    """Sends half of what it has (its update plus what it kept) and keeps the rest for the client's next round:
    error feedback's bookkeeping with per-client state."""

    kept = "half_residual"

    def transform(self, delta, replica, clients, before):
        total = delta + torch.stack([torch.zeros_like(delta[0]) if b is None else b for b in before])
        sent = total * 0.5
        return sent, {}, total - sent


class NeedsUpdates(UpdateStage):
    """A stage that must see every update (a server-side rule on the updates)."""

    needs = frozenset({"updates"})


fedharness.register_stage("clip_each", ClipEach, norm=1.0)
fedharness.register_stage("needs_updates", NeedsUpdates)
fedharness.register_stage("scale_by", ScaleBy, factor=1.0)

BASE = ["dataset=digits", "rounds=4", "eval_every=2", "progress=false", "threads=1", "reference=off",
        "heterogeneity=false", "dtype=float64", "replicas=2", "algorithm.local_steps=5", "dataset.data_seed=0"]
STAGE = f"stages=[{{name:clip_each,norm:{NORM}}}]"


def run(tmp_path, run_id: str, *extra: str) -> list[tuple]:
    return run_rows(BASE, tmp_path, run_id, *extra)


def one_round_moves(*extra: str) -> torch.Tensor:
    """How far each replica's model moves in one round: ||x_1 - x_0|| [R]."""
    run_ = prepare_run(load_settings([*BASE, *extra]))
    problem, algorithm = run_.problem, run_.algorithm
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 2), rounds=1, seed=0,
                    replicas=2, eval_every=1, stages=run_.stages)
    state = engine.initial_state()
    x0 = state.x.clone()
    return (engine.step(state).x - x0).norm(dim=1)


def test_a_users_stage_clips_every_update_of_a_round():
    """The server's step (sgd, lr 1, weights summing to 1) is a weighted mean of updates each clipped to NORM, so
    no replica moves further than NORM; without the stage they move further."""
    assert (one_round_moves(STAGE) <= NORM * (1 + 1e-12)).all()
    assert (one_round_moves() > 2 * NORM).all()


def test_the_stages_run_in_the_lists_order():
    """Clip to NORM then scale by 10 moves up to 10 NORM (and further than NORM here); scale then clip: NORM."""
    clip = f"{{name:clip_each,norm:{NORM}}}"
    clip_then_scale = one_round_moves(f"stages=[{clip},{{name:scale_by,factor:10}}]")
    scale_then_clip = one_round_moves(f"stages=[{{name:scale_by,factor:10}},{clip}]")
    assert (clip_then_scale <= 10 * NORM * (1 + 1e-12)).all() and (clip_then_scale > 2 * NORM).all()
    assert (scale_then_clip <= NORM * (1 + 1e-12)).all()


def test_a_users_stage_gives_the_same_bits_on_1_and_3_shards_and_in_a_batch_of_slots(tmp_path):
    from fedharness.runs.batch import Slot
    from fedharness.runs.execute import execute_batch

    one = run(tmp_path, "one", STAGE)
    assert one == run(tmp_path, "three", STAGE, "num_shards=3")
    assert one != run(tmp_path, "plain")  # the stage changed the run
    slots = [Slot(load_settings([*BASE, f"results_dir={tmp_path}", STAGE, *extra]), run_id=run_id)
             for run_id, extra in (("slot0", []), ("slot1", ["seed=1", "algorithm.client_lr=0.1"]))]
    assert [r.status for r in execute_batch(slots)] == ["ok", "ok"]
    assert rows(tmp_path, "slot0") == one
    assert rows(tmp_path, "slot1") == run(tmp_path, "alone1", STAGE, "seed=1", "algorithm.client_lr=0.1")


@pytest.mark.slow  # CI only: a local Ray
def test_a_users_stage_gives_the_inline_bits_on_2_ray_shards(local_ray, tmp_path):
    inline = run(tmp_path, "inline", STAGE)
    assert run(tmp_path, "ray", STAGE, "executor=ray", "ray.num_shards=2") == inline


def test_a_stage_that_needs_the_updates_runs_with_an_aggregator_that_sees_them():
    run_ = prepare_run(load_settings([*BASE, f"stages=[{{name:clip_each,norm:{NORM}}},needs_updates]",
                                      "algorithm=fedavg_median"]))
    assert [type(s).__name__ for s in run_.stages.stages] == ["ClipEach", "NeedsUpdates"]


@pytest.mark.parametrize("overrides,key,hint", [
    (["stages=[nope]"], "stages", "one of: attack, dp"),
    (["stages=[needs_updates]"], "algorithm.aggregator", "the stage needs_updates"),
    (["stages=[dp,dp]"], "stages", "each stage at most once"),
    (["stages=[dp]", "attack=alie", "algorithm=fedavg_median"], "stages", "attack=alie runs as the stage"),
    (["stages=[attack]", "dp.noise_multiplier=1", "algorithm.sampler=poisson"], "stages", "runs as the stage 'dp'"),
    (["dp.noise_multiplier=1"], "algorithm.sampler", "add algorithm.sampler=poisson, or run algorithm=dp_fedavg"),
    (["stages=[{name:clip_each,nope:1}]"], "stages.nope", "its parameters: norm"),
])
def test_a_bad_stage_list_is_one_line_exit_2_and_nothing_written(overrides, key, hint, tmp_path, capsys):
    results = tmp_path / "out"
    assert main(["run", f"results_dir={results}", *BASE, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{key}'" in err and hint in err, err
    assert not results.exists()


def test_a_dp_run_names_its_sampler_and_dp_fedavg_sets_it(tmp_path):
    settings = load_settings([*BASE, "algorithm=dp_fedavg", "dp.noise_multiplier=1"])
    assert settings.algorithm.sampler == "poisson" and settings.config["algorithm"]["sampler"] == "poisson"
    assert load_settings([*BASE]).algorithm.sampler == "scheme_i"  # nothing rewritten where DP is off


def test_fedharness_config_stages_lists_the_stages_and_their_keys(capsys):
    assert main(["config", "stages"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "update stages (`stages=[...]` in the order they run; the default: [attack,compress,dp]):"
    names = out[1].strip().split(", ")
    assert names[:3] == ["attack", "dp", "compress"] and {"clip_each", "scale_by", "needs_updates"} <= set(names)
    assert any(line.startswith("  dp.clip_norm = 1.0 ") for line in out)
    assert main(["config", "stages", "clip_each"]) == 0
    one = capsys.readouterr().out.splitlines()
    assert one[3].startswith("clip_each: Clip each client's update to `norm` in the shards (no noise)")
    assert one[4].split() == ["norm", "=", "1.0"]
    assert main(["config", "stages", "nope"]) == 2
    assert "invalid value for 'stages': 'nope' (one of: attack, dp, " in capsys.readouterr().err


def per_client(updates) -> dict[tuple[int, int], torch.Tensor]:
    return {(int(r), int(k)): d.double() for c in updates for r, k, d in zip(c.replica, c.clients, c.delta)}


@pytest.mark.parametrize("shards", [1, 3])
def test_a_stages_per_client_state_stays_with_the_client(shards):
    """Two rounds from the same model and plan (so each client's update d is the same twice): the first sends d/2
    and keeps d/2, the second sends (d + d/2)/2 and keeps as much; what was sent plus what is kept is 2d, and the
    shard that owns the client holds it under the work's name, at any shard count."""
    settings = load_settings([*BASE])
    problem, algorithm = build_parts(settings)
    executor = InlineExecutor(problem, algorithm.solver, shards)
    x = problem.init_params(2, 0)
    sel = algorithm.sampler.select(0, np.arange(2), 0, problem.weights)
    plan = RoundPlan(0, 0, np.arange(2), sel.clients, sel.weights, np.full(sel.clients.shape, 5), sel.lr_scale,
                     np.full(5, 0.05), send_updates=True)
    raw = per_client(executor.local_updates(x, plan).updates)
    plan.stages = (HalfFeedback(),)
    first = per_client(executor.local_updates(x, plan).updates)
    second = per_client(executor.local_updates(x, plan).updates)
    kept = {key: s["half_residual"] for key, s in executor.get_state().items()}
    assert set(first) == set(second) == set(raw) == set(kept) and len(raw) > 10  # scheme_i draws with replacement
    for key, d in raw.items():
        assert torch.equal(first[key], d * 0.5)
        scale = float(d.abs().max())
        assert float((first[key] + second[key] + kept[key] - 2 * d).abs().max()) <= 8 * 2.2e-16 * scale
        assert float((kept[key] - 0.75 * d).abs().max()) <= 4 * 2.2e-16 * scale
