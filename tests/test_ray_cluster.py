"""Starting and joining Ray: bad cluster input fails fast with one message; a real two-node cluster
(ray.cluster_utils.Cluster: a GCS and a raylet per node, all on 127.0.0.1) gets shards on both nodes,
survives losing a node, and tears down cleanly."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fedharness.core import ray_cluster
from fedharness.config.load import load_settings
from fedharness.errors import ConfigError
from ray_support import (QUADRATIC, assert_rows_match, descendants, eventually, inline_trajectory, max_rel_diff,
                         read_rounds, trajectory)

REPO = Path(__file__).resolve().parent.parent
OWN_RAY = True  # its clusters are its own, and it checks that a failed connect leaves no Ray (conftest)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.parametrize("override,key", [
    ("ray.num_shards=0", "ray.num_shards"),
    ("ray.cpus_per_shard=0", "ray.cpus_per_shard"),
    ("ray.gpus_per_shard=0.5", "ray.gpus_per_shard"),  # a GPU share needs device=cuda
    ("ray.placement=scatter", "ray.placement"),
    ("ray.address=headnode", "ray.address"),
    ("ray.address=ray://10.0.0.1:10001", "ray.address"),
    ("ray.connect_timeout_s=-1", "ray.connect_timeout_s"),
    ("checkpoint_every=-2", "checkpoint_every"),
    ("resume=../elsewhere", "resume"),
])
def test_bad_ray_keys_are_named(run_config, override, key):
    with pytest.raises(ConfigError) as err:
        run_config("executor=ray", override)
    assert err.value.key == key


@pytest.mark.parametrize("executor", ["ray", "inline"])  # inline: also refused, as an address, not echoed
def test_credentials_in_the_address_are_refused_without_echoing_them(run_config, executor):
    with pytest.raises(ConfigError) as err:
        run_config(f"executor={executor}", "ray.address=admin:s3cret@10.0.0.1:6379")
    assert err.value.key == "ray.address"
    assert "s3cret" not in str(err.value) and "RAY_AUTH_TOKEN_PATH" in str(err.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedharness.cli", "run", *QUADRATIC, "rounds=2", "progress=false",
                           f"results_dir={tmp_path / 'results'}", "executor=ray", *overrides],
                          cwd=REPO, env=ONE_THREAD, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 6 s idle
def test_unreachable_address_is_one_message_and_no_files(tmp_path):
    done = _cli(tmp_path, f"ray.address=127.0.0.1:{_free_port()}", "ray.connect_timeout_s=5")
    assert done.returncode == 2
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedharness: error: invalid value for 'ray.address'")
    assert "nothing accepts connections" in lines[0]
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_a_shard_bigger_than_this_machine_is_refused_before_ray_starts(tmp_path):
    done = _cli(tmp_path, "ray.cpus_per_shard=4096")
    assert done.returncode == 2 and "'ray.cpus_per_shard'" in done.stderr and "local Ray" in done.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_a_port_that_is_not_ray_is_a_bounded_wait():
    import ray

    with socket.socket() as listener:  # accepts TCP, never speaks gRPC: ray.init alone would wait for minutes
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        with pytest.raises(ConfigError) as err:
            ray_cluster.connect(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=3)
    assert err.value.key == "ray.address" and "no Ray GCS answered within 3 s" in err.value.allowed
    assert not ray.is_initialized()


# ---------------------------------------------------------------- a real two-node cluster

@pytest.fixture(scope="module")
def two_nodes():
    """Head (2 CPUs) and a second node (1 CPU, custom resource `second_node`), both on 127.0.0.1."""
    import ray
    from ray.cluster_utils import Cluster

    fast_failure_detection = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                              "health_check_initial_delay_ms": 0}
    with ray_cluster.loopback_only():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2,
                                                                "_system_config": fast_failure_detection})
        second = cluster.add_node(num_cpus=1, resources={"second_node": 1})
    cluster.wait_for_nodes()
    yield cluster, second
    ray.shutdown()
    cluster.shutdown()
    assert not [cmd for cmd in descendants().values() if "raylet" in cmd], "raylets left behind"


def _joined(run_config, cluster, *overrides: str):
    return run_config("algorithm=scaffold", "algorithm.client_lr=0.1", *QUADRATIC, "rounds=12", "executor=ray",
                      f"ray.address={cluster.address}", *overrides)


@pytest.mark.slow
def test_spread_shards_land_on_both_nodes_and_follow_inline(two_nodes, run_config):
    import ray
    from fedharness.backends.ray_executor import RayExecutor
    from fedharness.assembly.build import build_parts

    cluster, second = two_nodes
    cfg = _joined(run_config, cluster, "ray.num_shards=2", "ray.placement=spread")
    want, _, _ = inline_trajectory(cfg, 12)
    problem, algorithm = build_parts(cfg)
    executor = RayExecutor(cfg, problem, algorithm.solver)
    try:
        nodes = executor.shard_nodes()
        got, _ = trajectory(cfg, executor, 12, problem, algorithm)
        pg_id = executor.pg.id.hex()
    finally:
        executor.close()
    assert sorted(nodes) == sorted([cluster.head_node.node_id, second.node_id])
    assert ray.nodes() and all(n["Alive"] for n in ray.nodes())
    assert max_rel_diff(got, want) < 1e-6
    assert eventually(lambda: ray.util.placement_group_table()[pg_id]["state"] == "REMOVED")  # released


@pytest.mark.slow
def test_pack_keeps_shards_on_one_node(two_nodes, run_config):
    from fedharness.backends.ray_executor import RayExecutor
    from fedharness.assembly.build import build_parts

    cluster, _ = two_nodes
    cfg = _joined(run_config, cluster, "ray.num_shards=2", "ray.placement=pack")
    problem, algorithm = build_parts(cfg)
    executor = RayExecutor(cfg, problem, algorithm.solver)
    try:
        assert len(set(executor.shard_nodes())) == 1
    finally:
        executor.close()


@pytest.mark.slow
def test_shard_bigger_than_any_node_names_the_key(two_nodes, run_config):
    from fedharness.backends.ray_executor import RayExecutor
    from fedharness.assembly.build import build_parts

    cluster, _ = two_nodes
    cfg = _joined(run_config, cluster, "ray.cpus_per_shard=3")  # the cluster has 3 CPUs, no node has 3
    problem, algorithm = build_parts(cfg)
    with pytest.raises(ConfigError) as err:
        RayExecutor(cfg, problem, algorithm.solver)
    assert err.value.key == "ray.cpus_per_shard" and "largest node has 2 CPU" in err.value.allowed


@pytest.mark.slow
def test_losing_the_second_node_mid_run_keeps_parquet_exact(two_nodes, tmp_path):
    """Last in the module: the second node leaves after round 6; its shard moves to the head and replays."""
    import ray
    from fedharness.runs.execute import execute

    cluster, second = two_nodes
    run = ["algorithm=scaffold", "algorithm.client_lr=0.1", *QUADRATIC, "rounds=12", "eval_every=2",
           "progress=false"]
    want_cfg = load_settings([*run, f"results_dir={tmp_path / 'inline'}"])
    execute(want_cfg, run_id="inline")
    cfg = load_settings([*run, f"results_dir={tmp_path / 'ray'}", "executor=ray", f"ray.address={cluster.address}",
                       "ray.num_shards=2", "ray.placement=spread"])
    removed = []

    def on_eval(rows, state):
        if state.round == 6:
            bundles = [t["bundles_to_node_id"] for t in ray.util.placement_group_table().values()
                       if t["state"] == "CREATED"]
            assert any(second.node_id in b.values() for b in bundles)  # a shard really is on the second node
            cluster.remove_node(second)
            removed.append(second.node_id)

    result = execute(cfg, run_id="lost-node", on_eval=on_eval)
    assert result.status == "ok" and removed
    assert not [n for n in ray.nodes() if n["NodeID"] == second.node_id and n["Alive"]]
    assert_rows_match(read_rounds(tmp_path / "ray", "lost-node"), read_rounds(tmp_path / "inline", "inline"))


_NICENESS = """
import os, ray
from fedharness.core import ray_cluster
conn = ray_cluster.start_local(num_cpus=1)
print(ray.get(ray.remote(lambda: os.nice(0)).remote()))
conn.close()
"""


@pytest.mark.slow
def test_the_embedded_rays_workers_run_at_the_drivers_priority():
    """Ray's default nice 15 for workers starves the shards beside any other work (ray_cluster.start_local)."""
    env = {k: v for k, v in ONE_THREAD.items() if k != "RAY_worker_niceness"}
    out = subprocess.run([sys.executable, "-c", _NICENESS], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == str(os.nice(0))
