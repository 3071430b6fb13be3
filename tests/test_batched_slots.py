"""Hyperparameters on the replica axis (harness/runs/batch.py, harness/core/slots.py): every slot of a batched run
gives the rows its settings give alone, to 1e-6 relative in float32 and 1e-12 in float64, inline and on Ray; a
slot that diverges, finishes its rounds or is pruned leaves the batch without changing the others; each slot is
its own run in runs/, with the batch's id."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest

from fedharness.runs.batch import Slot, batch_key, batchable, check_batch
from fedharness.runs.execute import execute_batch
from fedharness.config.load import load_settings
from fedharness.errors import ConfigError
from fedharness.runs.execute import execute

SMALL = ["dataset.num_clients=12", "dataset.samples_per_client=40", "dataset.data_seed=0",
         "algorithm.clients_per_round=4", "algorithm.local_steps=3", "algorithm.batch_size=8", "rounds=12",
         "eval_every=4", "reference=off", "heterogeneity=false", "threads=1", "progress=false"]
# The base slot and one slot per batchable key, each differing from the base in that key only.
MOMENTUM = ["algorithm.server_optimizer=momentum", "algorithm.server_momentum=0.5"]
SLOTS = {
    "base": [],
    "client_lr": ["algorithm.client_lr=0.11"],
    "server_lr": ["algorithm.server_lr=0.7"],
    "local_steps": ["algorithm.local_steps=5"],
    "mu": ["algorithm.mu=0.3"],
    "momentum": ["algorithm.momentum=0.6"],
    "server_momentum": ["algorithm.server_momentum=0.8"],
    "lr_schedule": ["algorithm.lr_schedule=inverse_round"],
    "lr_decay": ["algorithm.lr_decay=0.9"],
    "seed": ["seed=3"],
    "rounds": ["rounds=6"],
    "eval_every": ["eval_every=3"],
    "replicas": ["replicas=2"],
}
NUMBERS = ("train_loss", "grad_norm_sq", "test_loss", "test_acc", "lr", "server_lr", "tau_eff", "chi2", "sim_s")
EXACT = ("replica", "series", "round", "local_steps", "grad_evals", "bytes_up", "bytes_down")
RUN_COLUMNS = ("study", "algorithm", "dataset", "seed", "n_replicas", "status", "rounds_done", "error", "trial",
               "f_star", "callbacks", "metrics", "split_invariant")


def rounds_table(results, run_id: str) -> list[dict]:
    rows = pq.read_table(results / "rounds" / f"run_id={run_id}").to_pylist()
    return sorted(rows, key=lambda r: (r["round"], r["replica"], r["series"]))


def run_row(results, run_id: str) -> dict:
    return pq.read_table(results / "runs" / f"run_id={run_id}").to_pylist()[0]


def same_config(got: str, want: str) -> bool:
    """Equal configs but for results_dir (the solo runs write beside the batch)."""
    got, want = json.loads(got), json.loads(want)
    return got.pop("results_dir") != want.pop("results_dir") and got == want


def assert_same_rows(got: list[dict], want: list[dict], rel: float) -> None:
    assert [tuple(r[c] for c in EXACT) for r in got] == [tuple(r[c] for c in EXACT) for r in want]
    for g, w in zip(got, want):
        for c in NUMBERS:
            if w[c] is None:
                assert g[c] is None, (c, g["round"])
            else:
                assert math.isclose(g[c], w[c], rel_tol=rel, abs_tol=rel * 1e-3), (c, g["round"], g[c], w[c])


def solo_and_batch(tmp_path, overrides: dict[str, list[str]], common: list[str], on_eval=None):
    """Each slot alone (results under solo/) and all as one batch (under batch/): (solo ids, batch results)."""
    def load(where: str, extra: list[str]):
        return load_settings([f"results_dir={tmp_path / where}", *SMALL, *common, *extra])

    solo = {name: execute(load("solo", extra), run_id=f"solo-{name}") for name, extra in overrides.items()}
    slots = [Slot(load("batch", extra), f"batch-{name}", (on_eval or {}).get(name))
             for name, extra in overrides.items()]
    batch = dict(zip(overrides, execute_batch(slots, batch_id="the-batch")))
    return solo, batch


@pytest.mark.parametrize("dtype,rel", [("float32", 1e-6), pytest.param("float64", 1e-12, marks=pytest.mark.slow)])
@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 6 s idle
def test_every_batchable_key_gives_each_slot_its_solo_rows(tmp_path, dtype, rel):
    solo, batch = solo_and_batch(tmp_path, SLOTS, [*MOMENTUM, f"dtype={dtype}"])
    for name in SLOTS:
        assert batch[name].status == solo[name].status == "ok", name
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{name}"),
                         rounds_table(tmp_path / "solo", f"solo-{name}"), rel)
        got, want = run_row(tmp_path / "batch", f"batch-{name}"), run_row(tmp_path / "solo", f"solo-{name}")
        assert got["batch_id"] == "the-batch" and want["batch_id"] is None
        assert {c: got[c] for c in RUN_COLUMNS} == {c: want[c] for c in RUN_COLUMNS}
        assert same_config(got["config_json"], want["config_json"])
    assert run_row(tmp_path / "batch", "batch-rounds")["rounds_done"] == 6


def test_scaffold_client_state_follows_its_slot_when_another_leaves(tmp_path):
    """SCAFFOLD keeps c_i per (replica, client) in the shards: when the 6-round slot leaves, the later slots'
    states move with their rows (3 inline shards)."""
    slots = {"short": ["rounds=6"], "base": [], "client_lr": ["algorithm.client_lr=0.02"], "seed": ["seed=5"]}
    solo, batch = solo_and_batch(tmp_path, slots, ["algorithm=scaffold", "num_shards=3", "dtype=float64"])
    for name in slots:
        assert batch[name].status == "ok"
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{name}"),
                         rounds_table(tmp_path / "solo", f"solo-{name}"), 1e-12)


def test_a_diverging_slot_leaves_the_batch_and_the_others_keep_their_rows(tmp_path):
    slots = {"base": [], "diverges": ["algorithm.client_lr=1e6", "algorithm.server_lr=1e6"],
             "after": ["algorithm.client_lr=0.02"]}
    solo, batch = solo_and_batch(tmp_path, slots, ["dtype=float64"])
    assert solo["diverges"].status == batch["diverges"].status == "diverged"
    got, want = run_row(tmp_path / "batch", "batch-diverges"), run_row(tmp_path / "solo", "solo-diverges")
    assert got["rounds_done"] == want["rounds_done"] < 12
    for name in slots:
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{name}"),
                         rounds_table(tmp_path / "solo", f"solo-{name}"), 1e-12)


def test_a_pruned_slot_ends_alone_with_status_pruned(tmp_path):
    optuna = pytest.importorskip("optuna")

    def prune_at_4(rows, state):
        if rows[0]["round"] == 4:
            raise optuna.TrialPruned("at round 4")

    seen = []
    slots = {"base": [], "pruned": ["algorithm.client_lr=0.02"], "after": ["algorithm.local_steps=4"]}
    solo, batch = solo_and_batch(tmp_path, slots, ["dtype=float64"],
                                 on_eval={"pruned": prune_at_4, "after": lambda rows, state: seen.append(state.x)})
    assert batch["pruned"].status == "pruned" and batch["base"].status == batch["after"].status == "ok"
    row = run_row(tmp_path / "batch", "batch-pruned")
    assert row["status"] == "pruned" and row["rounds_done"] == 4 and "TrialPruned" in row["error"]
    assert [r["round"] for r in rounds_table(tmp_path / "batch", "batch-pruned")] == [0, 4]
    assert [tuple(x.shape) for x in seen] == [(1, seen[0].shape[1])] * 4  # on_eval sees its slot's model only
    for name in ("base", "after"):
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{name}"),
                         rounds_table(tmp_path / "solo", f"solo-{name}"), 1e-12)


def test_runs_that_differ_in_more_than_batchable_keys_are_refused_before_any_file(tmp_path):
    def load(*extra):
        return load_settings([f"results_dir={tmp_path}", *SMALL, *extra])

    assert batchable(load("algorithm.client_lr=0.3", "seed=4", "study=other"), load("rounds=3"))
    assert not batchable(load("dataset.data_seed=null"), load("dataset.data_seed=null", "seed=1"))  # other data
    with pytest.raises(ConfigError, match="algorithm.clients_per_round"):
        execute_batch([Slot(load()), Slot(load("algorithm.clients_per_round=5"))])
    with pytest.raises(ConfigError, match="checkpoint_every"):
        execute_batch([Slot(load("checkpoint_every=2"))])
    assert batch_key(load()) == batch_key(load("algorithm.mu=0.5"))
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("dtype,rel", [("float32", 1e-6), ("float64", 1e-12)])
def test_slots_on_ray_shards_give_their_solo_inline_rows(local_ray, tmp_path, dtype, rel):
    names = ("base", "client_lr", "local_steps", "mu", "momentum", "server_momentum", "seed", "rounds", "replicas")
    common = [*MOMENTUM, f"dtype={dtype}", "algorithm=scaffold"]

    def load(where, extra):
        return load_settings([f"results_dir={tmp_path / where}", *SMALL, *common, *extra])

    for name in names:
        execute(load("solo", SLOTS[name]), run_id=f"solo-{name}")
    slots = [Slot(load("batch", [*SLOTS[name], "executor=ray", "ray.num_shards=2"]), f"batch-{name}")
             for name in names]
    assert [r.status for r in execute_batch(slots)] == ["ok"] * len(names)
    for name in names:
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{name}"),
                         rounds_table(tmp_path / "solo", f"solo-{name}"), rel)


ALGORITHMS = {
    "fednova_random_epochs": ["algorithm=fednova", "algorithm.local_work=random_epochs", "algorithm.epochs_low=1",
                              "algorithm.epochs_high=2"],
    "median": ["algorithm=fedavg_median"],  # an aggregator that sees the updates
    "fedadam": ["algorithm=fedadam"],
    "scheme_ii_transformed": ["algorithm=fedavg_scheme_ii_transformed"],
    "nesterov_fedprox": ["algorithm=fedprox", "algorithm.nesterov=true"],
    "2nn_float32": ["model=2nn"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", ALGORITHMS)
def test_other_parts_give_each_slot_its_solo_rows(tmp_path, case):
    slots = {"base": [], "client_lr": ["algorithm.client_lr=0.02"], "rounds": ["rounds=5"], "seed": ["seed=4"],
             "mu": ["algorithm.mu=0.2"], "momentum": ["algorithm.momentum=0.5"],
             "local_steps": ["algorithm.local_steps=2"]}
    dtype, rel = ("float32", 1e-6) if "float32" in case else ("float64", 1e-12)
    solo, batch = solo_and_batch(tmp_path, slots, [*ALGORITHMS[case], f"dtype={dtype}"])
    for name in slots:
        assert batch[name].status == solo[name].status == "ok"
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{name}"),
                         rounds_table(tmp_path / "solo", f"solo-{name}"), rel)


QUADRATIC = ["dataset=quadratic", "dataset.noise=0.5", "dataset.num_clients=8", "algorithm.clients_per_round=4",
             "reference=off", "heterogeneity=false", "threads=1", "progress=false", "dtype=float64"]


def test_gradient_noise_is_each_clients_own_whatever_trains_beside_it(tmp_path):
    """The quadratic's noise for a client's step t is drawn for its own local steps, not for the longest of the
    copies it trains with: slots of E = 1, 2, 4 give their solo rows, and random local steps give the same rows
    on 1 and 3 shards."""
    def load(where, *extra):
        return load_settings([f"results_dir={tmp_path / where}", *QUADRATIC, *extra])

    slots = {E: [f"algorithm.local_steps={E}", f"rounds={40 // E}", "eval_every=2"] for E in (1, 2, 4)}
    for E, extra in slots.items():
        execute(load("solo", *extra), run_id=f"solo-{E}")
    execute_batch([Slot(load("batch", *extra), f"batch-{E}") for E, extra in slots.items()])
    for E in slots:
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{E}"), rounds_table(tmp_path / "solo", f"solo-{E}"),
                         1e-12)
    random = ["algorithm.local_work=random_steps", "algorithm.steps_low=1", "algorithm.steps_high=4", "rounds=10"]
    for shards in (1, 3):
        execute(load("shards", *random, f"num_shards={shards}"), run_id=f"shards-{shards}")
    one, three = (rounds_table(tmp_path / "shards", f"shards-{n}") for n in (1, 3))
    assert [(r["train_loss"], r["grad_norm_sq"]) for r in one] == [(r["train_loss"], r["grad_norm_sq"]) for r in three]


def test_an_error_of_the_batch_ends_every_slot_failed_and_recorded(tmp_path, monkeypatch):
    from fedharness.core.engine import BatchedEngine

    real = BatchedEngine.step

    def step(self, state):
        if state.round == 5:
            raise RuntimeError("the executor broke")
        return real(self, state)

    monkeypatch.setattr(BatchedEngine, "step", step)
    settings = [load_settings([f"results_dir={tmp_path}", *SMALL, *extra]) for extra in ([], ["rounds=3"], ["seed=2"])]
    results = execute_batch([Slot(s, f"run-{i}") for i, s in enumerate(settings)])
    assert [r.status for r in results] == ["failed", "ok", "failed"]
    assert results[0].error == "RuntimeError: the executor broke" and results[1].error is None
    row = run_row(tmp_path, "run-0")
    assert (row["status"], row["rounds_done"], row["error"]) == ("failed", 5, "RuntimeError: the executor broke")
    assert [r["round"] for r in rounds_table(tmp_path, "run-0")] == [0, 4]  # the rows before it, kept


def test_only_the_slots_due_at_a_round_are_evaluated_in_one_pass(tmp_path, monkeypatch):
    """eval_every 4 (two replicas) and 3: at rounds 3, 6, 9 only the second slot's row is evaluated, at 4, 8 only
    the first's two, at 0 and 12 all three, each time in one problem.evaluate; the rows stay the solo runs'."""
    from fedharness.core.engine import BatchedEngine

    seen, real = [], BatchedEngine._evaluate_series
    monkeypatch.setattr(BatchedEngine, "_evaluate_series", lambda self, state, x, series, replica_ids:
                        seen.append((state.round, len(x), [int(r) for r in replica_ids])) or
                        real(self, state, x, series, replica_ids))
    overrides = {"four": ["replicas=2"], "three": ["eval_every=3"]}
    solo_and_batch(tmp_path, overrides, [])
    assert seen == [(0, 3, [0, 1, 2]), (3, 1, [2]), (4, 2, [0, 1]), (6, 1, [2]), (8, 2, [0, 1]), (9, 1, [2]),
                    (12, 3, [0, 1, 2])]
    for name in overrides:
        assert_same_rows(rounds_table(tmp_path / "batch", f"batch-{name}"),
                         rounds_table(tmp_path / "solo", f"solo-{name}"), 1e-6)


def test_runs_that_differ_only_in_seed_without_a_data_seed_are_refused_naming_what_to_set():
    """The seed also draws the data while dataset.data_seed is null: the refusal names `seed` (what the user set)
    and says to set dataset.data_seed, never 'dataset.data_seed: None' for a key the user did not set."""
    first, other = (load_settings(["rounds=2", f"seed={seed}"]) for seed in (0, 1))
    with pytest.raises(ConfigError) as err:
        check_batch([first, other])
    assert err.value.key == "seed" and err.value.value == 1
    assert "set dataset.data_seed" in str(err.value)
    check_batch([load_settings(["rounds=2", "dataset.data_seed=0", f"seed={seed}"]) for seed in (0, 1)])
