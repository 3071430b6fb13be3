"""The command line: the default run end to end, `list`, and bad input (one message, exit 2, no files)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

from fedharness.cli import main

FEDHARNESS = [sys.executable, "-m", "fedharness.cli"]


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 34 s idle
def test_default_run_end_to_end(tmp_path):
    """`make run` is `fedharness run` with the defaults: Synthetic(1,1), N=100, K=10, E=20, b=24."""
    proc = subprocess.run([*FEDHARNESS, "run"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "train_loss" in proc.stdout and "status=ok" in proc.stdout
    assert "rounds:" in proc.stderr  # progress bar
    rounds = ds.dataset(tmp_path / "results" / "rounds", partitioning="hive").to_table().to_pylist()
    assert sorted(r["round"] for r in rounds) == list(range(0, 101, 10))
    final = max(rounds, key=lambda r: r["round"])
    # Scheme I draws with replacement: a client drawn twice trains once and counts twice in the average.
    from fedharness.problems import synthetic
    from fedharness.algorithms.samplers import SchemeI

    sizes = np.array([int(0.9 * synthetic.client_size(0, k)) for k in range(100)])
    sampler = SchemeI(100, 10)
    distinct = sum(len(np.unique(sampler.select(0, np.arange(1), r, sizes / sizes.sum()).clients))
                   for r in range(100))
    assert final["local_steps"] == 100 * 20 and final["grad_evals"] == distinct * 20 * 24
    assert distinct < 1000
    first = min(rounds, key=lambda r: r["round"])
    assert final["train_loss"] < 0.8 * first["train_loss"]
    assert final["subopt"] > 0 and final["test_acc"] > 0.5


def test_list_shows_registered_names(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("synthetic", "quadratic", "digits", "mnist", "fashion_mnist", "cifar10", "dirichlet",
                 "classes_per_client", "shards", "powerlaw", "natural", "iid", "logreg", "linreg", "2nn", "cnn",
                 "vgg11", "resnet18", "fedavg", "fednova", "scheme_i", "scheme_ii"):
        assert name in out, name


BAD_INPUT = [
    (["dataset=nope"], "'dataset': 'nope'", "synthetic"),
    (["algorithm=nope"], "'algorithm': 'nope'", "fedavg"),
    (["model=nope"], "'model': 'nope'", "logreg"),
    (["partition=nope"], "'partition': 'nope'", "dirichlet"),
    (["algorithm.sampler=nope"], "'algorithm.sampler': 'nope'", "scheme_ii"),
    (["algorithm.client_lr=-0.1"], "'algorithm.client_lr': -0.1", "> 0"),
    (["algorithm.client_lr=0"], "'algorithm.client_lr': 0", "> 0"),
    (["algorithm.batch_size=0"], "'algorithm.batch_size': 0", ">= 1"),
    (["algorithm.sampler=scheme_ii", "algorithm.clients_per_round=101"], "'algorithm.clients_per_round': 101",
     "without replacement"),
    (["dataset=digits", "partition=classes_per_client", "partition.classes=11"], "'partition.classes': 11",
     "between 1 and 10"),
    (["dataset=digits", "partition=dirichlet", "partition.alpha=0"], "'partition.alpha': 0", "> 0"),
    (["dataset=digits", "partition=dirichlet", "partition.alpha=-1"], "'partition.alpha': -1", "> 0"),
    (["algorithm.nosuchkey=1"], "'algorithm.nosuchkey'", "client_lr"),
    (["rounds=0"], "'rounds': 0", ">= 1"),
    (["dtype=float16"], "'dtype': 'float16'", "float64"),
]


@pytest.mark.parametrize("overrides,names,allowed", BAD_INPUT)
def test_bad_input_one_message_exit_2_no_files(overrides, names, allowed, tmp_path, capsys):
    results = tmp_path / "results"
    assert main(["run", f"results_dir={results}", "progress=false", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedharness: error: invalid value for ")
    assert names in err[0] and allowed in err[0]
    assert not results.exists()


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_missing_data_files_say_which_and_where(tmp_path):
    proc = subprocess.run([*FEDHARNESS, "run", "dataset=mnist", f"dataset.data_dir={tmp_path / 'd'}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "dataset.data_dir" in proc.stderr and "train-images-idx3-ubyte" in proc.stderr
    assert str(tmp_path / "d" / "MNIST" / "raw") in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not Path(tmp_path / "results").exists()


def test_run_help_shows_groups_keys_defaults_and_docs(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage: fedharness run" in out
    groups = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "*" in line}
    assert "fedavg*" in groups["algorithm"] and "fednova" in groups["algorithm"]
    assert "synthetic*" in groups["dataset"] and "auto*" in groups["partition"]
    assert re.search(r"^  rounds = 100 +communication rounds$", out, re.M)
    assert re.search(r"^  ray\.num_shards = 2 +long-lived ClientShard actors", out, re.M)


def test_config_group_shows_its_keys_defaults_and_docs(capsys):
    assert main(["config", "algorithm"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  algorithm\.client_lr = 0\.05 +eta_L / gamma, the client step size$", out, re.M)
    assert "fedprox" in out  # the group's options
    assert main(["config", "algorithm", "fedprox"]) == 0
    assert re.search(r"^  algorithm\.mu = 0\.01 +proximal term", capsys.readouterr().out, re.M)
    assert main(["config", "dataset", "quadratic"]) == 0
    assert re.search(r"^  dataset\.curvature = identity +identity \| diagonal \| random", capsys.readouterr().out,
                     re.M)
    assert main(["config", "nope"]) == 2
    assert "'group': 'nope'" in capsys.readouterr().err


def test_cfg_job_prints_the_resolved_config_and_runs_nothing(tmp_path, monkeypatch, capsys):
    import yaml

    monkeypatch.chdir(tmp_path)
    assert main(["run", "--cfg", "job", "algorithm=fedprox", "algorithm.client_lr=0.2", "results_dir=out"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["algorithm"]["client_lr"] == 0.2 and cfg["algorithm"]["mu"] == 0.01 and cfg["rounds"] == 100
    assert list(tmp_path.iterdir()) == []
    assert main(["run", "--cfg", "job", "rounds=0"]) == 2  # validated, not just composed


@pytest.mark.parametrize("argv", [["run", "-m", "algorithm=fedavg,fednova"], ["run", "algorithm=fedavg,fednova"],
                                  ["run", "algorithm.client_lr=0.1,0.2"]])
def test_several_values_point_at_sweep(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fedharness sweep" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_a_list_value_is_one_value(capsys):
    assert main(["run", "--cfg", "job", "algorithm.decay_at=[0.3,0.6]", "wandb.tags=[a,b]"]) == 0
    assert "- 0.3" in capsys.readouterr().out


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 4 s idle
def test_a_closed_pipe_ends_quietly():
    """`fedharness run --help | head -3`: the reader goes away before the help is written; no traceback."""
    proc = subprocess.Popen([*FEDHARNESS, "run", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command has even imported: every write it makes hits a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
