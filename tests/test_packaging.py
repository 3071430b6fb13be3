"""The wheel is self-contained: installed into a fresh venv, `fedharness` runs from any directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("harness", "algorithms", "partitions", "conf", "pyproject.toml", "README.md")


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


def _fresh_venv(tmp: Path) -> Path:
    """A venv that sees this interpreter's installed dependencies through a .pth line, but not its fedharness:
    a directory added by a .pth line does not get its own .pth files run, so an editable install's finder
    there stays inactive."""
    venv = tmp / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


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
    install = _run([py, "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q", wheel], work)
    assert install.returncode == 0, install.stderr
    where = _run([py, "-c", "import fedharness.compose as c; print(c.__file__); print(c.CONF_DIR)"], work)
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
