"""Cluster jobs without a shared folder: a sweep's and a study's Ray tasks record through the driver
(harness/backends/results_writer.py), so every row lands, once, under the results_dir the driver names.

The cluster is real: a head node and a second node, each a process tree of its own on 127.0.0.1. The second node
runs from a private working directory, and (where the kernel lets an unprivileged user make a mount namespace) it
sees its private folder in place of the driver's folder, as a node of a cloud cluster sees its own disk at the same
path. Tasks are placed there by a custom resource the head lacks. Before the driver was the writer, the sweep's runs
(a relative results_dir) and the study's trial runs (an absolute one) landed in that private folder.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from fedharness.errors import ConfigError
from fedharness.studies.sweep import spec_from_dict
from ray_support import QUADRATIC, override_values

# Loopback only; token auth off (nothing outside this machine can reach these ports), so no token file is made.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
       "RAY_AUTH_MODE": "disabled"}

# One Ray node, its processes below this one: `head PORT` or `worker GCS_ADDRESS`, then CPUs and custom resources.
# Prints `ready` once the node is registered; ends its node when stdin closes or on SIGTERM.
_NODE = """
import json, signal, sys
import ray
from ray._private.node import Node
from ray._private.parameter import RayParams
from ray._private.services import wait_for_node
from fedharness.core.ray_cluster import loopback_only

role, where, cpus, resources = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
with loopback_only():
    params = RayParams(node_ip_address="127.0.0.1", num_cpus=cpus, num_gpus=0, resources=resources,
                       object_store_memory=150 * 2**20, min_worker_port=0, max_worker_port=0,
                       include_dashboard=False)
    if role == "head":
        params.update_if_absent(gcs_server_port=int(where))
    else:
        params.update_if_absent(gcs_address=where, include_log_monitor=False, node_manager_port=0)
        params.dashboard_agent_listen_port = None
    node = Node(params, head=role == "head", shutdown_at_exit=True, spawn_reaper=True)
    wait_for_node(node.gcs_address, node.plasma_store_socket_name, 60)
print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
sys.stdin.read()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_mask_folders() -> bool:
    """Whether this user may make a user + mount namespace (unshare -Urm) and bind a folder over another."""
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           "mount --bind /tmp /tmp"], capture_output=True, timeout=30)
    return done.returncode == 0


def _start_node(argv: list[str], cwd: Path) -> subprocess.Popen:
    node = subprocess.Popen(argv, cwd=cwd, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:  # keeps draining the node's output, so it never blocks on a full pipe
        for line in node.stdout:
            lines.append(line)
            if line.startswith("ready"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120):
        _stop_node(node)
        pytest.fail("a Ray node did not start:\n" + "".join(lines[-30:]))
    return node


def _stop_node(node: subprocess.Popen) -> None:
    node.stdin.close()  # the node's script returns and shuts its Ray processes down
    try:
        node.wait(60)
    except subprocess.TimeoutExpired:
        node.kill()
        node.wait(10)


@pytest.fixture(scope="module")
def private_node_cluster(tmp_path_factory):
    """(address, folders): a head (1 CPU) and a node with 2 CPUs and the custom resource `private_node`, started in
    folders["worker"]; where mount namespaces are allowed, that node sees folders["worker"] in place of
    folders["driver"]. folders["shared"] stands for a database server that every node reaches."""
    base = tmp_path_factory.mktemp("no-shared-folder")
    folders = {name: base / name for name in ("head", "driver", "worker", "shared")}
    for folder in folders.values():
        folder.mkdir()
    port = _free_port()
    head = _start_node([sys.executable, "-c", _NODE, "head", str(port), "1", "{}"], folders["head"])
    node_argv = [sys.executable, "-c", _NODE, "worker", f"127.0.0.1:{port}", "2", json.dumps({"private_node": 2})]
    if _can_mask_folders():
        node_argv = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                     f'mount --bind "{folders["worker"]}" "{folders["driver"]}" && exec "$@"', "sh", *node_argv]
    try:
        second = _start_node(node_argv, folders["worker"])
    except BaseException:
        _stop_node(head)
        raise
    yield f"127.0.0.1:{port}", folders
    _stop_node(second)
    _stop_node(head)


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "fedharness.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _recorded(results: Path, study: str) -> tuple[list[dict], list[dict]]:
    """The study's runs/ rows and the rounds/ rows of those runs."""
    runs = [r for r in ds.dataset(results / "runs", format="parquet", partitioning="hive").to_table().to_pylist()
            if r["study"] == study]
    rounds = ds.dataset(results / "rounds", format="parquet", partitioning="hive").to_table().to_pylist()
    ids = {r["run_id"] for r in runs}
    return runs, [r for r in rounds if r["run_id"] in ids]


def _assert_each_round_once(runs: list[dict], rounds: list[dict], evaluated: list[int], replicas: int) -> None:
    keys = [(r["run_id"], r["series"], r["round"], r["replica"]) for r in rounds]
    assert len(keys) == len(set(keys)), "a round is recorded twice"
    for run in runs:
        assert run["status"] == "ok" and run["rounds_done"] == evaluated[-1], run
        got = sorted((r["round"], r["replica"]) for r in rounds if r["run_id"] == run["run_id"]
                     and r["series"] == "iterate")
        assert got == [(t, k) for t in evaluated for k in range(replicas)], run["run_id"]


SWEEP = {"name": "nodriver", "results_dir": "results",  # relative: the driver's working directory
         "base": {**override_values(QUADRATIC), "rounds": 4, "eval_every": 2, "checkpoint_every": 2},
         "grid": {"seed": [0, 1, 2]}, "resources": {"num_cpus": 1, "private_node": 1}}


@pytest.mark.slow
def test_sweep_and_study_on_a_node_without_the_driver_folder_record_at_the_driver(private_node_cluster):
    address, folders = private_node_cluster
    driver, results = folders["driver"], folders["driver"] / "results"
    (driver / "nodriver.yaml").write_text(json.dumps({**SWEEP, "address": address}))
    sweep = _cli(driver, "sweep", "sweep=nodriver.yaml")
    assert "3 ok" in sweep.stdout, sweep.stdout
    tune = _cli(driver, "tune", "tune=quadratic_lr", "tune.space.client_lr.high=0.02", "results_dir=results",
                "tune.plots=false", "tune.n_trials=4", "tune.parallel=2", "tune.batch=2", f"tune.ray_address={address}",
                f"tune.storage=sqlite:///{folders['shared'] / 'optuna.db'}",  # a database every node reaches
                "tune.resources={num_cpus: 1, num_gpus: 0, private_node: 1}")

    # Nothing went to the second node's own folder: not by its working directory, nor by the driver's path.
    assert _files(folders["worker"]) == []
    assert not (folders["head"] / "results").exists()

    sweep_runs, sweep_rounds = _recorded(results, "nodriver")
    assert len(sweep_runs) == 3
    _assert_each_round_once(sweep_runs, sweep_rounds, [0, 2, 4], replicas=2)
    for run in sweep_runs:  # the checkpoints reached the driver too
        assert (results / "checkpoints" / f"run_id={run['run_id']}" / "state.pt").is_file()
    manifest = json.loads(next((results / "sweeps").glob("nodriver-*.json")).read_text())
    assert sorted(j["run_id"] for j in manifest["jobs"]) == sorted(r["run_id"] for r in sweep_runs)

    trial_runs, trial_rounds = _recorded(results, "quadratic_lr-fedavg")
    assert sorted(r["trial"] for r in trial_runs) == [0, 1, 2, 3]
    assert len({(r["run_id"], r["series"], r["round"], r["replica"]) for r in trial_rounds}) == len(trial_rounds)
    assert all(r["status"] == "ok" for r in trial_runs)
    assert all(r["batch_id"] is not None for r in trial_runs)  # tune.batch=2: slots of batched runs, through the driver
    trials = ds.dataset(results / "trials", format="parquet", partitioning="hive").to_table().to_pylist()
    assert sorted(t["run_id"] for t in trials) == sorted(r["run_id"] for r in trial_runs)
    assert "4 trials" in tune.stdout + tune.stderr

    report = _cli(driver, "report", "results")  # built at the driver, from what reached it
    assert "report:" in report.stdout
    with open(results / "report" / "tables" / "runs.csv", newline="") as f:
        reported = [row["run_id"] for row in csv.DictReader(f)]
    assert sorted(reported) == sorted(r["run_id"] for r in sweep_runs + trial_runs)


def test_a_sweep_requests_custom_ray_resources_by_name():
    spec = spec_from_dict({"resources": {"num_cpus": 1, "private_node": 0.5}}, "s")
    assert spec.resources == {"num_cpus": 1, "num_gpus": 0, "private_node": 0.5}
    with pytest.raises(ConfigError) as err:
        spec_from_dict({"resources": {"private_node": -1}}, "s")
    assert err.value.key == "sweep.resources.private_node" and err.value.value == -1
