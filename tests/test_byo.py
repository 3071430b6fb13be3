"""Bring your own: docs/extending.md's package and configs, written outside the checkout, registered and run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra.core.config_store import ConfigStore

import fedharness
from fedharness.algorithms.registry import PARTS
from fedharness.problems import DATASETS, MODELS
from fedharness.partitions import PARTITIONERS

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["dataset=gaussian", "algorithm.clients_per_round=3", "rounds=4", "eval_every=2", "progress=false"]


def write_example(root: Path) -> None:
    """Every code block of docs/extending.md whose first line is `# <relative path>`, written under root."""
    text = (ROOT / "docs" / "extending.md").read_text()
    for body in re.findall(r"```(?:python|yaml)\n(.*?)```", text, re.S):
        path = body.splitlines()[0][2:].strip()
        if re.fullmatch(r"[\w/]+\.(py|yaml)", path):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(body)


@pytest.fixture
def mypkg(tmp_path, monkeypatch):
    """The example package on sys.path; the registries restored afterwards."""
    write_example(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    saved = [(reg, dict(reg)) for reg in (MODELS, DATASETS, PARTITIONERS, *PARTS.values())]
    repo = ConfigStore.instance().repo
    stored = {g: set(repo.get(g, {})) for g in ("model", "dataset", "partition")}
    import mypkg.data
    import mypkg.nets
    import mypkg.parts

    yield mypkg, tmp_path
    for reg, old in saved:
        reg.clear()
        reg.update(old)
    for g, old in stored.items():
        for name in set(repo.get(g, {})) - old:
            del repo[g][name]
    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]


def _register(pkg) -> None:
    fedharness.register_model("tiny", pkg.nets.TinyNet, hidden=16)
    fedharness.register_dataset("gaussian", pkg.data.gaussian_classes, num_clients=6, n=600, dim=8, classes=3)
    fedharness.register_partitioner("label_blocks", pkg.parts.label_blocks)
    fedharness.register_part("solver", "clipped_sgd", pkg.parts.ClippedSGD)
    fedharness.register_part("aggregator", "uniform", pkg.parts.UniformAverage)


def test_registered_model_data_and_partitioner_run_and_are_listed(mypkg, capsys):
    pkg, tmp = mypkg
    _register(pkg)
    fedharness.register_dataset("gaussian_ds", pkg.data.gaussian_dataset, num_clients=6)
    r = fedharness.run(["model=tiny", "model.hidden=8", "partition=label_blocks", *SMALL])
    row = r.runs.loc[0]
    assert (row["status"], row["model"], row["dataset"], row["partition"]) == ("ok", "tiny", "gaussian",
                                                                                "label_blocks")
    losses = r.rounds["train_loss"].to_numpy()
    assert losses[-1] < 0.8 * losses[0] and r.rounds["test_acc"].notna().all()
    # the same training samples as a torch Dataset without a test split: the same trajectory, no test metrics
    ds = fedharness.run(["model=tiny", "model.hidden=8", "partition=label_blocks", *SMALL, "dataset=gaussian_ds"])
    np.testing.assert_allclose(ds.rounds["train_loss"], losses, rtol=1e-6)
    assert ds.rounds["test_acc"].isna().all()
    from fedharness.cli import cmd_list

    cmd_list()
    out = capsys.readouterr().out
    assert re.search(r"models:.*\btiny\b", out) and re.search(r"datasets:.*\bgaussian_ds\b", out)
    assert re.search(r"partitions:.*\blabel_blocks\b", out) and re.search(r"aggregators:.*\buniform\b", out)


def test_user_partitioner_splits_by_label(mypkg):
    from fedharness.config.load import load_settings
    from fedharness.assembly.build import build_parts

    pkg, _ = mypkg
    _register(pkg)
    problem, _ = build_parts(load_settings(["model=tiny", "partition=label_blocks", *SMALL]))
    y = problem.y.numpy()
    per_client = [np.unique(y[o:o + n]) for o, n in zip(problem.offsets, problem.sizes)]
    assert list(problem.sizes) == [80] * 6 and all(len(labels) <= 2 for labels in per_client)
    assert all(a.max() <= b.min() for a, b in zip(per_client, per_client[1:]))  # blocks of the label-sorted order


def test_user_solver_and_aggregator_replace_the_builtins(mypkg):
    """Equal client sizes and full participation: uniform weights are FedAvg's, and an unreached clip is plain SGD,
    so the trajectory is FedAvg's; a tiny clip holds the model near its start."""
    pkg, _ = mypkg
    _register(pkg)
    base = ["model=tiny", "algorithm.sampler=full", "algorithm.local_steps=3", *SMALL]
    fedavg = fedharness.run(base).rounds
    mine = fedharness.run([*base, "algorithm.solver=clipped_sgd", "+algorithm.clip=1e9",
                           "algorithm.aggregator=uniform"]).rounds
    np.testing.assert_allclose(mine["train_loss"], fedavg["train_loss"], rtol=1e-5)
    assert fedavg["chi2"].iloc[1:].notna().all() and mine["chi2"].isna().all()  # the user's aggregator ran
    held = fedharness.run([*base, "algorithm.solver=clipped_sgd", "+algorithm.clip=1e-4",
                           "algorithm.aggregator=uniform"]).rounds["train_loss"].to_numpy()
    moved = fedavg["train_loss"].iloc[0] - fedavg["train_loss"].iloc[-1]
    assert abs(held[0] - held[-1]) < 0.01 * moved


def test_a_module_with_buffers_and_dropout_runs(mypkg):
    pkg, tmp = mypkg
    _register(pkg)
    fedharness.register_model("bn", pkg.nets.BatchNormNet)
    result = fedharness.run(["model=bn", *SMALL, f"results_dir={tmp / 'res'}"])
    loss = result.rounds["train_loss"].to_numpy()
    assert result.status == "ok" and loss[-1] < loss[0]  # BatchNorm's statistics and dropout train along


def test_bad_registrations_are_named(mypkg):
    pkg, _ = mypkg
    with pytest.raises(fedharness.ConfigError, match="'model': 'cnn'.*built-in"):
        fedharness.register_model("cnn", pkg.nets.TinyNet)
    with pytest.raises(fedharness.ConfigError, match="'kind': 'optimizer'"):
        fedharness.register_part("optimizer", "x", pkg.parts.ClippedSGD)
    (x, y), _ = pkg.data.gaussian_classes(0)
    fedharness.register_dataset("raw", lambda seed: (x, y))  # (x, y) instead of (train, test)
    with pytest.raises(fedharness.ConfigError, match="'dataset': 'raw'.*must return \\(train, test\\)"):
        fedharness.run(["dataset=raw"])
    fedharness.register_dataset("floats", lambda seed: ((x, y + 0.5), None))
    with pytest.raises(fedharness.ConfigError, match="'dataset': 'floats'.*labels must be integers"):
        fedharness.run(["dataset=floats"])
    with pytest.raises(fedharness.ConfigError, match="'model._target_': 'nopkg.nets.Net'.*cannot be imported"):
        fedharness.run(["+model._target_=nopkg.nets.Net", "model.name=net"])


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 10 s idle
def test_target_configs_run_from_the_command_line_outside_the_checkout(mypkg):
    _, tmp = mypkg
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp)]),
           "FEDHARNESS_CONFIG_PATH": str(tmp / "myconf")}
    cmd = [sys.executable, "-m", "fedharness.cli", "run", "model=tiny", "partition=label_blocks", "algorithm=fedclip",
           *SMALL, "results_dir=out"]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    import pandas as pd

    runs = pd.read_parquet(tmp / "out" / "runs")
    assert runs.loc[0, ["status", "model", "dataset", "partition", "algorithm"]].tolist() == [
        "ok", "tiny", "gaussian", "label_blocks", "fedclip"]
    assert '"solver": "mypkg.parts.ClippedSGD"' in runs.loc[0, "config_json"]
    # the Python registration and the config files build the same run
    _register(mypkg[0])
    api = fedharness.run(["model=tiny", "partition=label_blocks", "algorithm.solver=clipped_sgd",
                          "+algorithm.clip=1.0", "algorithm.aggregator=uniform", *SMALL])
    cli = pd.read_parquet(tmp / "out" / "rounds")
    np.testing.assert_allclose(cli.sort_values("round")["train_loss"], api.rounds["train_loss"], rtol=1e-6)
