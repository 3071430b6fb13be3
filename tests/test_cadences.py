"""A cadence written in one file, as a notebook would write it (docs/extending.md, "Your own cadence"): FedAsync whose
step size adapts to each arrival's delay, registered with fedharness.register_option and run with no change to the
package: inline, on 3 shards, in a batch of seeds, resumed with clients in flight, and on Ray with the same bits;
against the built-in fedasync whose staleness function gives the same step sizes; and the stages' declarations
(contracts.UpdateStage place and last) deciding what combines with it and in which order."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

import fedharness
from fedharness.algorithms.cadences import FedAsync
from fedharness.algorithms.systems import ConstantStaleness
from fedharness.cli import main
from fedharness.config.load import load_settings
from fedharness.contracts import SHARDS, Coefficients, UpdateStage
from fedharness.runs.execute import execute
from test_systems import SEED, SIGMA, batch_rows, quadratic, resumed_rows, rows
from test_systems import world_rows as systems_world_rows

# --- the notebook's cell ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DelayAdaptive(FedAsync):
    """FedAsync whose mixing weight adapts to each arrival's delay tau: x <- (1 - a) x + a x_k, a = alpha / (1 + tau)."""

    def combine(self, e, state, cols, valid, held):
        x = state.x
        a = np.where(valid, self.alpha / (1.0 + (state.round - cols["version"])), 0.0)  # [R, 1]
        rs, ws = np.nonzero(valid)
        replica = torch.as_tensor(rs, device=x.device)
        models = held[replica, torch.as_tensor(ws, device=x.device)]  # each replica's one arrival x_k
        weight = torch.as_tensor(a[valid], dtype=torch.float64, device=x.device)[:, None]
        delta = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
        delta.index_add_(0, replica, weight * (models - x[replica].double()))
        nan = np.full(len(a), np.nan)
        return Coefficients(a, nan, nan.copy(), nan.copy()), delta


def delay_adaptive(clients_per_round: int, alpha: float = 0.6, concurrency: int | None = None,
                   max_staleness: int | None = None, retry_s: float = 60.0) -> DelayAdaptive:
    """FedAsync whose mixing weight adapts to each arrival's delay: a = alpha / (1 + tau)."""
    C = clients_per_round if concurrency is None else concurrency
    return DelayAdaptive(C, 1, max_staleness, ConstantStaleness(), "arrival", retry_s, alpha)


fedharness.register_option("cadence", "delay_adaptive", delay_adaptive, alpha=0.6, concurrency=None,
                           max_staleness=None)

# ------------------------------------------------------------------------------------------------------------------

WORLD = ["speed=lognormal", f"speed.step_sigma={SIGMA}", "cadence.concurrency=5", "cadence.max_staleness=4",
         "dataset.data_seed=0", "replicas=2", "rounds=24", "eval_every=6"]
MINE = ["cadence=delay_adaptive", *WORLD]


def world_rows(tmp_path, run_id: str, *extra: str) -> list[tuple]:
    return systems_world_rows(tmp_path, run_id, *extra, world=MINE)


def test_a_notebooks_cadence_is_listed_and_its_keys_checked(capsys):
    assert main(["config", "cadence", "delay_adaptive"]) == 0
    out = capsys.readouterr().out
    assert "cadence=delay_adaptive: FedAsync whose mixing weight adapts" in out and "cadence.alpha = 0.6" in out
    assert main(["run", *quadratic("rounds=1"), "cadence=delay_adaptive", "cadence.buffer=2"]) == 2
    assert "'cadence.buffer'" in capsys.readouterr().err


def test_a_notebooks_cadence_matches_the_builtin_with_the_same_step_sizes(tmp_path):
    """fedasync with staleness=poly, exponent 1, steps with a = alpha (1 + tau)^-1, the notebook's with
    alpha / (1 + tau): who arrives when depends on the profiles alone, so every counter and sim_s are equal; the two
    a's differ by at most 2 roundings (2^-52 relative), which 24 steps x <- (1 - a) x + a x_k on a contraction
    carry into x at most 24 x 4 x 2^-53 < 1.1e-14 relative, twice that into the quadratic's loss: rtol 1e-12."""
    mine = world_rows(tmp_path, "mine")
    settings = load_settings(quadratic(f"results_dir={tmp_path}", "cadence=fedasync", "staleness=poly",
                                       "staleness.exponent=1", *WORLD))
    assert execute(settings, run_id="builtin").status == "ok"
    builtin = rows(tmp_path, "builtin")
    exact = lambda rs: [r[:2] + r[3:] for r in rs]  # noqa: E731  (all but train_loss)
    assert exact(mine) == exact(builtin) and len(mine) == 10  # 2 replicas x 5 evaluations
    np.testing.assert_allclose([r[2] for r in mine], [r[2] for r in builtin], rtol=1e-12)
    assert mine[-1][2] < mine[0][2]  # the model moved toward the optimum


def test_a_notebooks_cadence_gives_the_same_rows_on_shards_in_a_batch_and_resumed(tmp_path):
    alone = world_rows(tmp_path, "alone")
    assert world_rows(tmp_path, "three", "num_shards=3") == alone

    assert resumed_rows(tmp_path, MINE, 13) == alone  # clients in flight at the checkpoint (round 10)
    first, second = batch_rows(tmp_path, MINE)
    assert first == [r for r in alone if r[0] == 0]
    assert second == world_rows(tmp_path, "solo-next", "replicas=1", f"seed={SEED + 1}")


@pytest.mark.slow  # CI: Ray's start-up
def test_a_notebooks_cadence_gives_the_inline_rows_on_ray(local_ray, tmp_path):
    """The Ray shards build the run's parts, cadence included (its sampler draws what the cadence asks): the
    notebook's registration reaches them."""
    assert world_rows(tmp_path, "ray", "executor=ray", "ray.num_shards=2") == world_rows(tmp_path, "inline")


# --- the stages' declarations -------------------------------------------------------------------------------------


class Rescale(UpdateStage):
    """Each update times `factor`, in its shard: a stage that declares its place."""

    place = SHARDS

    def __init__(self, factor: float = 1.0):
        self.factor = factor

    def client_work(self, plan, counters):
        return None


class Final(UpdateStage):
    """A stage whose change must be the last in the shards (as DP-FedAvg's clipping)."""

    last = True


fedharness.register_stage("rescale_everywhere", Rescale)
fedharness.register_stage("final_change", Final)


@pytest.mark.parametrize("stages,ok,hint", [
    ("[rescale_everywhere]", True, None),  # SHARDS: means the same whichever step an update joins
    ("[final_change]", False, "'stages': ['Final']"),  # ROUND (the default): refused with an asynchronous cadence
])
def test_what_a_cadence_spanning_versions_takes_follows_the_stages_place(stages, ok, hint, tmp_path, capsys):
    code = main(["run", f"results_dir={tmp_path / 'out'}", *quadratic("rounds=2"), *MINE, f"stages={stages}"])
    assert code == (0 if ok else 2)
    if not ok:
        assert hint in capsys.readouterr().err


def test_no_stage_in_the_shards_follows_one_that_must_be_last(tmp_path, capsys):
    assert main(["run", f"results_dir={tmp_path / 'out'}", *quadratic("rounds=2"),
                 "stages=[final_change,rescale_everywhere]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'stages'" in err[0] and "rescale_everywhere before final_change" in err[0], err
    assert not (tmp_path / "out").exists()
    assert main(["run", f"results_dir={tmp_path / 'ok'}", *quadratic("rounds=2"),
                 "stages=[rescale_everywhere,final_change]"]) == 0


def test_a_run_recorded_cadence_is_the_one_in_the_rounds(tmp_path):
    """The runs/ row records the chosen cadence and its keys (config_json), as every group's."""
    world_rows(tmp_path, "recorded")
    run = ds.dataset(tmp_path / "runs", format="parquet").to_table(columns=["config_json"]).to_pylist()[0]
    assert json.loads(run["config_json"])["cadence"] == {"name": "delay_adaptive", "retry_s": 60.0, "alpha": 0.6,
                                                         "concurrency": 5, "max_staleness": 4}
