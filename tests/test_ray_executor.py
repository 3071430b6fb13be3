"""The Ray executor on a real local Ray (127.0.0.1): the inline trajectory with 1, 2 and 3 shards.

One Ray instance serves the whole module. The full matrix (3 algorithms x 3 shard
counts) runs with FEDHARNESS_SLOW=1; the fast suite keeps one shard count per algorithm.
"""

from __future__ import annotations

import pytest
import ray
import torch

from fedharness.core import ray_cluster
from fedharness.config.compose import group_options
from fedharness.errors import ConfigError
from fedharness.backends.ray_executor import RayExecutor
from fedharness.assembly.build import build_parts
from fedharness.results.store import open_store
from ray_support import SMALL, eventually, inline_trajectory, max_rel_diff, trajectory

ROUNDS = 20
ALGORITHMS = {
    "fedavg_scheme_ii": ("fedavg_scheme_ii", ["algorithm.client_lr=0.1"]),
    "fednova_random_epochs": ("fednova", ["algorithm.local_work=random_epochs", "algorithm.epochs_low=1",
                                          "algorithm.epochs_high=3", "algorithm.client_lr=0.05"]),
    "scaffold": ("scaffold", ["algorithm.client_lr=0.1"]),
}
FAST = {("fedavg_scheme_ii", 2), ("fednova_random_epochs", 3), ("scaffold", 2)}
CASES = [pytest.param(name, shards, id=f"{name}-{shards}shards",
                      marks=() if (name, shards) in FAST else pytest.mark.slow)
         for name in ALGORITHMS for shards in (1, 2, 3)]




def _config(run_config, name: str, shards: int, *extra: str):
    config, overrides = ALGORITHMS[name]
    if config not in group_options("algorithm"):
        pytest.skip(f"conf/algorithm/{config}.yaml does not exist yet")
    return run_config(f"algorithm={config}", *overrides, *SMALL, f"rounds={ROUNDS}", "executor=ray",
                      f"ray.num_shards={shards}", *extra)


@pytest.mark.parametrize("name,shards", CASES)
@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 45 s idle
def test_ray_shards_follow_the_inline_trajectory(local_ray, run_config, name, shards, tmp_path):
    cfg = _config(run_config, name, shards)
    want, want_state, inline = inline_trajectory(cfg, ROUNDS)
    problem, algorithm = build_parts(cfg)
    cpus = ray.available_resources().get("CPU", 0.0)
    executor = RayExecutor(cfg, problem, algorithm.solver)
    try:
        assert ray.available_resources().get("CPU", 0.0) <= cpus - shards  # one 1-CPU bundle per shard
        got, got_state = trajectory(cfg, executor, ROUNDS, problem, algorithm)
        assert len(set(executor.shard_nodes())) == 1 and len(executor.shard_nodes()) == shards
        got_clients = executor.get_state()
        # what a resume does: the shards read the inline run's checkpointed client slots (every row)
        results = open_store(str(tmp_path / "results"))
        executor.restore(results, inline.checkpoint(results, "checkpoints/run_id=inline/clients", ROUNDS, every=True))
        round_trip = executor.get_state()
    finally:
        actors = list(executor.actors)
        executor.close()
    assert (want[-1] - want[0]).norm() > 0.1 * want[-1].norm()  # the model moved: the comparison means something
    assert max_rel_diff(got, want) < 1e-6
    for key, value in want_state.server_ctx.items():  # SCAFFOLD's server control variate
        assert max_rel_diff(got_state.server_ctx[key][None], value[None]) < 1e-6
    want_clients = inline.get_state()
    assert got_clients.keys() == want_clients.keys() == round_trip.keys()
    if name == "scaffold":
        assert len(want_clients) > problem.num_clients  # both replicas' sampled clients keep control variates
    for key, state in want_clients.items():
        for part, value in state.items():
            assert torch.allclose(got_clients[key][part], value, rtol=1e-6, atol=1e-10), key
            assert torch.equal(round_trip[key][part], value), key
    # close() ends the actors and returns the reservation, and leaves the module's Ray running
    assert ray.is_initialized()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ready.remote(), timeout=30)
    assert eventually(lambda: ray.available_resources().get("CPU", 0.0) == cpus)  # freed asynchronously


@pytest.mark.parametrize("override,key", [
    ("ray.cpus_per_shard=64", "ray.cpus_per_shard"),   # no node that big
    ("ray.num_shards=9", "ray.num_shards"),            # 9 CPUs asked of a 4-CPU cluster
])
def test_more_than_the_cluster_has_is_one_clear_error(local_ray, run_config, override, key):
    cfg = _config(run_config, "fedavg_scheme_ii", 2, override, "ray.reserve_timeout_s=5")
    problem, algorithm = build_parts(cfg)
    with pytest.raises(ConfigError) as err:
        RayExecutor(cfg, problem, algorithm.solver)
    assert err.value.key == key and "CPU" in err.value.allowed


def test_gpus_beyond_the_cluster_are_refused_by_name(local_ray):
    # device=cuda cannot be configured on this GPU-less machine, so the reservation is checked directly
    with pytest.raises(ConfigError) as err:
        ray_cluster.reserve(2, {"CPU": 1.0, "GPU": 0.5}, "spread", timeout_s=5)
    assert err.value.key == "ray.gpus_per_shard" and "GPU" in err.value.allowed


def test_busy_cluster_reservation_times_out_with_a_message(local_ray):
    hog = ray_cluster.reserve(1, {"CPU": 3.0}, "pack", timeout_s=30)
    try:
        with pytest.raises(ConfigError) as err:
            ray_cluster.reserve(2, {"CPU": 1.0}, "spread", timeout_s=2)
    finally:
        ray_cluster.release(hog)
    assert err.value.key == "ray.num_shards" and "could not reserve" in err.value.allowed


def test_a_refused_token_is_named_and_never_echoed(local_ray, monkeypatch):
    host, port = local_ray.address.rsplit(":", 1)
    wrong = "f" * 32
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", wrong)
    why = ray_cluster.probe_gcs(host, int(port), timeout_s=20)
    assert why is not None and "refused this driver's credentials" in why and wrong not in why
