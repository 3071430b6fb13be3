"""A round on a real multi-node Ray cluster on this machine: what a shard sends, and what moving it costs.

`ray.cluster_utils.Cluster` on 127.0.0.1: a head node without CPUs (the driver and its object store) and four
one-CPU worker nodes, each with its own raylet and object store, so every shard's reply crosses from one
node's store to another's as on a real cluster (over loopback TCP here, not a network). Every process runs one
torch thread.

For ResNet-18 (model=resnet18, its real 11.2M parameters, on 16x16 single-channel images) and the 2NN, inline
against 2 and 4 shards (placement spread): seconds per round, the bytes a shard's reply carries, the shards'
compute (the same client split trained in the driver, shard by shard: the largest is a round's critical path
when every shard has its own cores, the sum is what this 2-core machine does), and a reply's trip measured
with a probe actor on a worker node: `ray.put` there (serialising into its node's store), `ray.get` on the
driver (the transfer between the stores and deserialising), and `ray.get` of an object already in the driver's
store (deserialising alone). The probe sends a reply as each version of the code sent it: 240-bit limbs as a
torch tensor (tests/limb_sum.py: 56 bytes a parameter and replica, before issue 27), the compact exact sums (8
bytes) as a torch tensor, and the compact sums as they travel now (core/exact_sum.py NumpyWire: numpy arrays,
which Ray's object store moves without pickling), so "before" is measured on the same cluster. Prints a
table and writes benchmarks/out/cluster.json; docs/performance.md models an
8-GPU-node round from these figures.

    python benchmarks/bench_cluster.py [--rounds 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the worker nodes' processes inherit it
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

import fedharness  # noqa: E402
from fedharness.algorithms.series import build_series  # noqa: E402
from fedharness.assembly.build import build_parts  # noqa: E402
from fedharness.backends.ray_executor import RayExecutor  # noqa: E402
from fedharness.config.load import load_settings  # noqa: E402
from fedharness.core import ray_cluster  # noqa: E402
from fedharness.core.exact_sum import ExactSum  # noqa: E402
from fedharness.core.executors import ClientShard, InlineExecutor  # noqa: E402
from fedharness.runs.execute import Prepared, build_engine  # noqa: E402

OUT = Path(__file__).parent / "out"
NODES = 4
OLD_BYTES, NEW_BYTES = 56, 8  # a shard's reply per parameter and replica: 240-bit limbs (before), compact (now)
COMMON = ["dataset=cluster_images", "dataset.num_clients=8", "algorithm.sampler=full",
          "algorithm.batch_size=4", "algorithm.client_lr=0.05", "progress=false", "eval_every=1000000",
          "rounds=1000", "heterogeneity=false"]
MODELS = {"ResNet-18": ["model=resnet18", "algorithm.local_steps=1"],
          "2NN": ["model=2nn", "algorithm.local_steps=2"]}


def cluster_images(seed: int, n: int = 160, size: int = 16):
    """Random 1x16x16 images (a step's time does not depend on the pixels); defined here, so it travels to the
    shards by value."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 1, size, size)).astype(np.float32)
    return (x, rng.integers(0, 10, n)), None


class Probe:
    """On a worker node: a reply-sized payload put into that node's object store."""

    def put(self, wire: str, dim: int) -> tuple[list, float]:
        payload = WIRES[wire](dim)
        start = time.perf_counter()
        ref = ray.put(payload)
        return [ref], time.perf_counter() - start  # in a list: the driver gets the reference, not the data


WIRES = {  # a reply of one replica of `dim` parameters, as each version of the code sent it
    "limbs, torch (before)": lambda dim: torch.ones(dim, OLD_BYTES // 8, dtype=torch.float64),
    "compact, torch": lambda dim: torch.ones(dim, dtype=torch.float64),
    "compact, numpy (now)": lambda dim: ExactSum(torch.ones(1, dim, dtype=torch.float64)),
}


def start_cluster():
    from ray.cluster_utils import Cluster

    with ray_cluster.loopback_only():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 2 * 10**9,
                                                                "include_dashboard": False})
        for _ in range(NODES):
            cluster.add_node(num_cpus=1, object_store_memory=2 * 10**9)
    cluster.wait_for_nodes()
    ray_cluster.connect(cluster.address)
    return cluster


def trip(probe, wire: str, dim: int, repeats: int) -> dict[str, float]:
    """Median seconds of a reply in `wire`'s form: put on its node, fetched by the driver, and deserialised from
    the driver's own store."""
    put_s, get_s, local_s = [], [], []
    for _ in range(repeats):
        refs, seconds = ray.get(probe.put.remote(wire, dim))
        start = time.perf_counter()
        value = ray.get(refs[0])
        get_s.append(time.perf_counter() - start)
        put_s.append(seconds)
        local = ray.put(value)
        del value, refs
        start = time.perf_counter()
        value = ray.get(local)
        local_s.append(time.perf_counter() - start)
        del value, local
    return {"put_s": statistics.median(put_s), "get_s": statistics.median(get_s),
            "deserialise_s": statistics.median(local_s)}


def round_seconds(cfg, problem, algorithm, executor, rounds: int) -> list[float]:
    engine = build_engine(Prepared(cfg, problem, algorithm, None, *build_series(1)), executor)
    state = engine.step(engine.initial_state())  # warm-up: torch's first calls, the shards' first clients
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        state = engine.step(state)
        times.append(time.perf_counter() - start)
    return times


def shard_compute(problem, algorithm, owned, x, plan) -> list[float]:
    """Seconds each shard's clients take to train in this process (one thread), the split the Ray run used."""
    seconds = []
    for lo_hi in owned:
        shard = ClientShard(problem, algorithm.solver, lo_hi)
        start = time.perf_counter()
        shard.train(x, plan)
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(name: str, overrides: list[str], probe, rounds: int, repeats: int) -> dict:
    cfg = load_settings([*COMMON, *overrides])
    problem, algorithm = build_parts(cfg)
    record: dict = {"dim": problem.dim, "inline_s": round_seconds(cfg, problem, algorithm,
                                                                   InlineExecutor(problem, algorithm.solver), rounds)}
    for shards in (2, 4):
        on_ray = load_settings([*COMMON, *overrides, "executor=ray", f"ray.num_shards={shards}",
                                "ray.placement=spread"])
        executor = RayExecutor(on_ray, problem, algorithm.solver)
        try:
            engine = build_engine(Prepared(on_ray, problem, algorithm, None, *build_series(1)), executor)
            state = engine.initial_state()
            plan, _ = engine.plan_round(state.round)
            replies = executor._call_all("train", ray.put(state.x), ray.put(plan))
            record[f"ray{shards}"] = {
                "s_per_round": round_seconds(on_ray, problem, algorithm, executor, rounds),
                "reply_bytes": [reply.nbytes for reply, _ in replies],
                "nodes": len(set(executor.shard_nodes())),
                "compute_s": shard_compute(problem, algorithm, executor.owned, state.x, plan)}
        finally:
            executor.close()
    record["trip"] = {wire: trip(probe, wire, problem.dim, repeats) for wire in WIRES}
    print(table(name, record), flush=True)
    return record


def table(name: str, r: dict) -> str:
    mb = 1e6
    lines = [f"{name} (dim {r['dim']:,}): inline {statistics.median(r['inline_s']):.3f} s/round"]
    for shards in (2, 4):
        v = r[f"ray{shards}"]
        lines.append(f"  {shards} shards on {v['nodes']} nodes: {statistics.median(v['s_per_round']):.3f} s/round; "
                     f"a shard's reply {max(v['reply_bytes']) / mb:.2f} MB; shard compute max "
                     f"{max(v['compute_s']):.3f} s, sum {sum(v['compute_s']):.3f} s")
    for wire, t in r["trip"].items():
        size = r["dim"] * (OLD_BYTES if wire.startswith("limbs") else NEW_BYTES) / mb
        lines.append(f"  a reply, {wire} ({size:.1f} MB): put on its node {t['put_s']:.3f} s, fetched by the "
                     f"driver {t['get_s']:.3f} s (deserialising alone {t['deserialise_s']:.3f} s)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per variant, after one warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="trips of each reply size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fedharness.register_dataset("cluster_images", cluster_images, num_clients=8)
    start = time.perf_counter()
    cluster = start_cluster()
    record: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "nodes": NODES, "loadavg_at_start": os.getloadavg()}
    try:
        worker = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU", 0) > 0)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = ray.remote(Probe).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            worker, soft=False)).remote()
        for name, overrides in MODELS.items():
            record[name] = measure(name, overrides, probe, args.rounds, args.repeats)
    finally:
        ray.shutdown()
        cluster.shutdown()
    record["seconds"] = time.perf_counter() - start
    record["loadavg_at_end"] = os.getloadavg()
    OUT.mkdir(exist_ok=True)
    (OUT / "cluster.json").write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
