"""The wheel is self-contained: installed into a fresh venv, `fedharness` runs from any directory, under the one
name `fedharness`; without the extras, the default benchmark runs and each optional feature asks for its extra in
one line. Library output goes through `logging`: a run from Python prints nothing it was not asked for."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import fedharness
from fedharness.assembly import reference_policy
from fedharness.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("harness", "algorithms", "partitions", "conf", "pyproject.toml", "README.md", "LICENSE")
# What only the extras install (and scipy, which nothing needs): left out of the no-extras venv, by import name
EXTRAS_ONLY = ("ray", "wandb", "wandb_workspaces", "optuna", "cmaes", "sqlalchemy", "psycopg", "sklearn", "scipy",
               "h5py", "datasets", "orjson", "dp_accounting")
# ... and by the names of their files in site-packages (packages, .dist-info, .libs)
LEFT_OUT = {*EXTRAS_ONLY, "psycopg_binary", "psycopg2", "psycopg2_binary", "scikit_learn"}


def _build_wheel(tmp: Path) -> Path:
    """Build from a copy of the sources, so the checkout gets no build/ or egg-info (offline: no isolation)."""
    src = tmp / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(src)], check=True)
    (wheel,) = (tmp / "dist").glob("fedharness-*.whl")
    return wheel


def _fresh_venv(tmp: Path, core_only: bool = False) -> Path:
    """A venv that sees this interpreter's installed dependencies through a .pth line, but not its fedharness:
    a directory added by a .pth line does not get its own .pth files run, so an editable install's finder
    there stays inactive. `core_only`: the .pth line names a copy of site-packages (links) without LEFT_OUT,
    so those packages are not installed there as far as imports and importlib.metadata can tell."""
    venv = tmp / ("fresh-core" if core_only else "fresh")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    deps = Path(sysconfig.get_paths()["purelib"])
    if core_only:
        filtered = tmp / "site-packages-core"
        filtered.mkdir()
        for entry in deps.iterdir():
            if entry.name.lower().replace("-", ".").split(".")[0] not in LEFT_OUT:
                (filtered / entry.name).symlink_to(entry)
        deps = filtered
    Path(purelib, "deps.pth").write_text(f"{deps}\n")
    return venv


def _install(venv: Path, wheel: Path, cwd: Path) -> None:
    install = _run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q",
                    wheel], cwd)
    assert install.returncode == 0, install.stderr


def _run(cmd: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDHARNESS_CONF")}
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_wheel_runs_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    venv = _fresh_venv(tmp_path)
    py = venv / "bin" / "python"
    work = tmp_path / "elsewhere"
    work.mkdir()
    # Before installing, fedharness must not be importable: the test really exercises the wheel.
    probe = _run([py, "-c", "import harness"], work)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, probe.stderr
    _install(venv, wheel, work)
    where = _run([py, "-c", "import fedharness.config.compose as c; print(c.__file__); print(c.CONF_DIR)"], work)
    module_file, conf_dir = where.stdout.split()
    assert module_file.startswith(str(venv)) and conf_dir.startswith(str(venv)), where.stdout

    run = _run([venv / "bin" / "fedharness", "run", "rounds=3", "eval_every=1", "progress=false"], work)
    assert run.returncode == 0, run.stderr
    rounds = pq.read_table(work / "results" / "rounds").to_pandas()
    assert sorted(rounds["round"].unique()) == [0, 1, 2, 3]
    runs = pq.read_table(work / "results" / "runs").to_pandas()
    assert list(runs["status"]) == ["ok"]

    listing = _run([venv / "bin" / "fedharness", "list"], work)
    assert listing.returncode == 0, listing.stderr
    algorithms = next(line for line in listing.stdout.splitlines() if line.startswith("algorithms:"))
    assert {"fedavg", "fednova", "scaffold", "fedprox"} <= set(algorithms.split(":", 1)[1].replace(",", " ").split())

    # One import namespace: the repository's folder names are not importable from an installed fedharness.
    for name in ("algorithms", "partitions", "harness"):
        probe = _run([py, "-c", f"import {name}"], work)
        assert probe.returncode != 0 and f"No module named '{name}'" in probe.stderr, (name, probe.stderr)
    assert _run([py, "-c", "import fedharness.algorithms, fedharness.partitions"], work).returncode == 0
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"fedharness", f"fedharness-{fedharness.__version__}.dist-info"}
    assert "fedharness/py.typed" in names


@pytest.mark.slow
def test_core_install_runs_and_each_feature_names_its_extra(tmp_path):
    """`pip install fedharness` without extras: the default benchmark runs and writes Parquet; asking for Ray,
    W&B, Optuna or scikit-learn's data set is one line naming the extra, exit status 2, and no result files."""
    wheel = _build_wheel(tmp_path)
    venv = _fresh_venv(tmp_path, core_only=True)
    py, fh = venv / "bin" / "python", venv / "bin" / "fedharness"
    work = tmp_path / "elsewhere"
    work.mkdir()
    _install(venv, wheel, work)
    for name in EXTRAS_ONLY:
        probe = _run([py, "-c", f"import {name}"], work)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, (name, probe.stderr)

    run = _run([fh, "run", "rounds=3", "eval_every=1", "progress=false"], work)
    assert run.returncode == 0, run.stderr
    rounds = pq.read_table(work / "results" / "rounds").to_pandas()
    assert sorted(rounds["round"].unique()) == [0, 1, 2, 3]
    assert list(pq.read_table(work / "results" / "runs").to_pandas()["status"]) == ["ok"]

    for args, extra, module in ((["run", "executor=ray"], "ray", "ray"),
                                (["run", "wandb.enabled=true"], "wandb", "wandb"),
                                (["run", "dataset=digits"], "data", "sklearn.datasets"),
                                (["tune", "tune=quadratic_lr"], "tune", "optuna")):
        out = _run([fh, *args, f"results_dir={tmp_path / extra}"], work)
        lines = out.stderr.splitlines()
        assert out.returncode == 2 and len(lines) == 1, (args, out.stderr)
        assert lines[0].startswith("fedharness: error: ") and lines[0].endswith(
            f"(needs the '{extra}' extra: pip install 'fedharness[{extra}]' (no module named '{module}'))"), lines
        assert not (tmp_path / extra).exists(), args  # stopped before any result file


def test_a_run_from_python_prints_nothing_and_the_command_line_shows_the_log_lines(tmp_path, monkeypatch, capfd,
                                                                                   caplog):
    """In a notebook, fedharness.run(..., progress=False) writes nothing to stdout or stderr: its notes go to
    the `fedharness` loggers (NullHandler); the command line shows them as `fedharness: <message>`."""
    separable = {"dataset": "blobs", "dataset.std": 0.05, "dataset.num_clients": 4, "dataset.samples_per_client": 50,
                 "model": "logreg", "model.l2": 0, "rounds": 2, "eval_every": 1}  # no minimiser: a warning
    monkeypatch.setattr(reference_policy, "_REPORTED", set())
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="fedharness"):
        result = fedharness.run(separable, progress=False, results_dir=str(tmp_path / "api"))
    assert result.status == "ok"
    assert capfd.readouterr() == ("", "")
    note = "no exact reference: model.l2=0 (the optimum may not exist); subopt and dist_to_opt are null. " \
           "reference=on forces a solve."
    assert ("fedharness.assembly.reference_policy", "WARNING", note) in [(r.name, r.levelname, r.getMessage())
                                                                 for r in caplog.records]

    monkeypatch.setattr(reference_policy, "_REPORTED", set())
    argv = ["run", *(f"{k}={v}" for k, v in separable.items()), "progress=false", f"results_dir={tmp_path / 'cli'}"]
    assert cli_main(argv) == 0
    out, err = capfd.readouterr()
    assert err.splitlines() == [f"fedharness: {note}"] and "status=ok" in out
    handlers = logging.getLogger("fedharness").handlers  # the command's handler is gone again
    assert handlers and all(isinstance(h, logging.NullHandler) for h in handlers)
