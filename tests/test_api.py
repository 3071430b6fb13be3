"""The Python API (`import fedharness`): same results as the command line, DataFrames of the Parquet rows."""

from __future__ import annotations

import json

import pytest

import fedharness
from fedharness.api import as_overrides
from fedharness.cli import main as cli_main

RUN = {"dataset": "digits", "dataset.num_clients": 5, "algorithm": {"clients_per_round": 3, "local_steps": 2},
       "rounds": 4, "eval_every": 2, "progress": False}
RUN_ARGS = ["dataset=digits", "dataset.num_clients=5", "algorithm.clients_per_round=3", "algorithm.local_steps=2",
            "rounds=4", "eval_every=2", "progress=false"]
METRICS = ["replica", "series", "round", "local_steps", "grad_evals", "bytes_up", "train_loss", "test_loss",
           "test_acc", "grad_norm_sq"]


def test_mappings_and_keywords_become_the_overrides_hydra_parses():
    ovs = as_overrides({"algorithm": {"client_lr": 0.1, "decay_at": [0.5, 0.75]}, "wandb.entity": None,
                        "dataset": "digits", "wandb": {"tags": ["a b"]}}, seed=2, progress=False)
    assert ovs == ["algorithm.client_lr=0.1", "algorithm.decay_at=[0.5,0.75]", "wandb.entity=null",
                   "dataset=digits", "wandb.tags=['a b']", "seed=2", "progress=false"]
    assert as_overrides(["rounds=3"], seed=1) == ["rounds=3", "seed=1"]


def test_run_returns_the_rows_the_command_line_writes_for_the_same_config(tmp_path, capsys):
    result = fedharness.run(RUN, results_dir=str(tmp_path / "api"))
    assert cli_main(["run", *RUN_ARGS, f"results_dir={tmp_path / 'cli'}"]) == 0
    cli_id = capsys.readouterr().out.split("run ")[-1].split(":")[0]
    cli = fedharness.Result(tmp_path / "cli", {cli_id: "ok"})

    assert result.status == "ok" and result.runs.loc[0, "status"] == "ok"
    api_rounds, cli_rounds = result.rounds, cli.rounds
    assert list(api_rounds["round"]) == [0, 2, 4] and set(api_rounds["run_id"]) == {result.run_id}
    assert api_rounds[METRICS].equals(cli_rounds[METRICS])  # same code path: bit-identical trajectories
    assert result.rounds["train_loss"].iloc[-1] == result.rows[-1]["train_loss"]
    api_cfg, cli_cfg = (json.loads(r.runs.loc[0, "config_json"]) for r in (result, cli))
    assert api_cfg["algorithm"]["local_steps"] == 2 and api_cfg == {**cli_cfg, "results_dir": api_cfg["results_dir"]}


def test_bad_input_raises_config_error_and_writes_nothing(tmp_path):
    with pytest.raises(fedharness.ConfigError, match="'algorithm.sampler': 'nope'.*scheme_ii"):
        fedharness.run({"algorithm": {"sampler": "nope"}}, dataset="digits", results_dir=str(tmp_path))
    with pytest.raises(fedharness.ConfigError, match="'dataset': 'nope'"):
        fedharness.run(["dataset=nope"], results_dir=str(tmp_path))
    with pytest.raises(fedharness.ConfigError, match="'overrides'"):
        fedharness.run("rounds=3")
    assert not any(tmp_path.iterdir())


def test_sweep_returns_every_run_of_the_grid(tmp_path, caplog):
    caplog.set_level("INFO", logger="fedharness")
    result = fedharness.sweep(["sweep=algorithms", "sweep.runner=local", "algorithm=fedavg,fednova",
                               "algorithm.clients_per_round=3", "dataset.num_clients=5", "rounds=4", "replicas=1",
                               "dataset.samples_per_client=20", "algorithm.local_steps=2", "progress=false",
                               f"sweep.results_dir={tmp_path}"])
    assert sorted(result.statuses.values()) == ["ok", "ok"]
    runs = result.runs.set_index("run_id")
    assert sorted(runs["algorithm"]) == ["fedavg", "fednova"]
    assert result.rounds.groupby("run_id")["round"].max().to_dict() == {i: 4 for i in result.run_ids}
    assert "sweep algorithms done" in caplog.text  # progress lines go to the `fedharness.api` logger


def test_tune_returns_the_trials_and_the_best_params(tmp_path):
    study = fedharness.tune(["tune=quadratic_lr", "tune.n_trials=3", "tune.plots=false", "tune.budget.total=5",
                             f"results_dir={tmp_path}", "progress=false"])
    assert len(study.trials) == 3 and set(study.trials["status"]) <= {"ok", "diverged", "pruned"}
    best = study.trials.loc[study.trials["value"].idxmin()]
    assert study.best_value == best["value"] and set(study.best_params) == {"client_lr"}
