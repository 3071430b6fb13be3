"""`executor=ray`: long-lived ClientShard actors on a Ray cluster.

Each shard actor owns a fixed, cost-balanced set of clients (cost n_k x expected
local steps), builds its own data from the run's settings (generated from the seed, or
read from `data_dir` on its node), keeps its clients' state (SCAFFOLD control
variates) and returns per-replica exact partial sums (core/exact_sum.py: 8 bytes a parameter and replica, the
grid rebuilt by the driver from x; numpy arrays on the wire, which the object store moves without pickling). The model goes out once
per round through the object store: one `ray.put(x)` whose reference every shard
receives. The sampled clients, their local steps and minibatches come from
streams keyed by (seed, replica, round, client), so the trajectory equals the
inline one bit for bit (with `sums: float`, up to float reassociation of the shard sums).

Faults: a shard whose actor dies (process killed, node lost) is started again in
its reserved bundle, rebuilds its data, reads its clients' slots from the files of
the resumed checkpoint and of the snapshots since (since the last compacting snapshot,
which holds every shard's whole table: client_store.COMPACT_AFTER), re-runs the rounds since the last
snapshot (same inputs, so the same state) and then the failed round. Every
SNAPSHOT_EVERY rounds while clients keep slots, each shard writes the rows changed
since its last snapshot to a folder the driver names (a local temporary folder: on a
cluster of several nodes, a folder every node sees; core/client_store.py): the driver
holds the files' names only, never the slots.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import shutil
import tempfile

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedharness.core import client_store, ray_cluster
from fedharness.errors import ConfigError, require
from fedharness.contracts import ClientScores
from fedharness.core.executors import ClientShard, RoundPlan, ShardResult, balanced_ranges, merge_scores
from fedharness.core.personal import FineTune
from fedharness.results.store import open_store
from fedharness.assembly.build import algorithm_for, build_parts
from fedharness.registry.plugins import Carried, install, snapshot, travel_by_value
from fedharness.problems.population import total_size
from fedharness.base.runtime import apply_runtime
from fedharness.settings import RunSettings

SNAPSHOT_EVERY = 10  # rounds of replay history kept in memory for stateful solvers (SCAFFOLD)
RECOVERABLE = (RayActorError, ObjectLostError, WorkerCrashedError, NodeDiedError)
COST_ROUNDS = 4  # rounds of local work averaged to estimate each client's expected steps


class ShardActor:
    """One ClientShard in its own process. Built from the settings (they travel as their plain config), never
    from the driver's arrays."""

    def __init__(self, settings: RunSettings, owned: tuple[int, int], threads: int, plugins: tuple[Carried, ...] = ()):
        self.rss_at_start = _peak_rss_bytes()  # the process with its imports, before any data
        torch.set_num_threads(threads)
        self.error = None
        try:
            install(plugins)  # the driver's Python registrations, before anything is built
            apply_runtime(settings.precision, settings.deterministic)  # in the shard processes too
            problem, algorithm = build_parts(settings)
        except ConfigError as err:  # e.g. data_dir missing on this node: reported by ready(), with the node
            self.error = (err.key, err.value, err.allowed)
            return
        self.shard = ClientShard(problem, algorithm.solver, owned, settings.sums == "exact",
                                 settings.client_slots_on_disk)
        self.device = problem.device

    def ready(self) -> dict:
        info = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "error": self.error,
                "host_ip": ray.util.get_node_ip_address(), "threads": torch.get_num_threads()}
        if self.error is None:
            info["fingerprint"] = problem_fingerprint(self.shard.problem)
        return info

    def train(self, x: torch.Tensor, plan: RoundPlan) -> tuple[ShardResult, bool]:
        dev = self.device
        plan = dataclasses.replace(plan, server_ctx={k: v.to(dev) for k, v in plan.server_ctx.items()})
        result = self.shard.train(x.to(dev), plan)
        return result.reply(), bool(self.shard.store)  # the sums' words: the driver builds the grids

    def checkpoint(self, url: str, prefix: str, rnd: int, reader: str, every: bool = False) -> list[str]:
        """This shard's changed slots (`every`: all) written by itself into the store at `url`; the keys."""
        return self.shard.checkpoint(open_store(url), prefix, rnd, reader, every)

    def restore(self, parts: list[tuple[str, list[str]]]) -> None:
        """Its clients' slots from the files `parts` [(store url, keys)], in order."""
        for url, keys in parts:
            self.shard.restore(open_store(url), keys)

    def keep_replicas(self, rows: np.ndarray) -> None:
        self.shard.keep_replicas(rows)

    def client_scores(self, x: torch.Tensor, replicas: np.ndarray, clients: np.ndarray,
                      finetune: FineTune | None = None) -> ClientScores:
        return self.shard.client_scores(x.to(self.device), replicas, clients, finetune)

    def get_state(self) -> dict:
        return self.shard.get_state()

    def close(self) -> None:
        self.shard.close()

    def memory(self) -> dict[str, int]:
        """Peak resident bytes of this process: at start (imports only) and so far."""
        return {"at_start": self.rss_at_start, "peak": _peak_rss_bytes()}


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


FINGERPRINT_PROBES = 4096  # clients whose sizes the fingerprint reads (evenly spread; all of them when fewer)


def problem_fingerprint(problem) -> tuple:
    """What a shard's data must agree on with the driver's: shapes, the total size and the sizes of up to
    FINGERPRINT_PROBES clients (O(1) in N)."""
    n = int(problem.num_clients)
    probes = np.unique(np.linspace(0, n - 1, min(n, FINGERPRINT_PROBES)).astype(np.int64))
    sizes = np.asarray(problem.sizes[probes], dtype=np.int64)
    return (n, int(problem.dim), str(problem.dtype), total_size(problem.sizes),
            int((sizes * (probes + 1)).sum() % (1 << 61)))


def shard_costs(seed: int, problem, local_work, batch_size: int):
    """Client k's expected cost: its local steps averaged over a few rounds of its own local-work stream (a
    round generates or gathers steps x b rows of a client, whatever its n_k). A function of the clients asked
    about, so balanced_ranges reads it at a bounded number of clients."""
    def cost_of(clients: np.ndarray) -> np.ndarray:
        taus = [local_work.steps(seed, np.zeros(1, dtype=np.int64), r, clients[None, :], problem.sizes, batch_size)
                for r in range(COST_ROUNDS)]
        return np.mean(taus, axis=0)[0].astype(np.float64)
    return cost_of


class RayExecutor:
    """Shards as Ray actors; `local_updates` has the InlineExecutor's contract."""

    def __init__(self, settings: RunSettings, problem, solver):
        ray_settings = settings.ray
        self.settings, self.ray_settings, self.problem = settings, ray_settings, problem
        n, cpus, gpus = ray_settings.num_shards, float(ray_settings.cpus_per_shard), float(ray_settings.gpus_per_shard)
        self.bundle = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}
        # the run's threads (resolved and recorded: a resumed run's shards compute as before), within the CPUs a
        # shard reserves
        self.threads = max(1, min(int(cpus), settings.threads or int(cpus)))
        self.pg, self.actors, self.infos = None, [], []
        self.restarts = 0
        self._restore: list[tuple[str, list[str]]] = []  # (store url, keys): the files a restarted shard reads
        self._snapshots = tempfile.mkdtemp(prefix="fedharness-snapshots-")  # the shards' snapshot files
        self._snapshot_round = 0
        self._history: list[tuple[ray.ObjectRef, ray.ObjectRef]] = []
        self.plugins = snapshot()  # the user's registrations, for every shard (and every restarted one)
        if ray_settings.address is None and not ray.is_initialized():
            cores = os.cpu_count() or 1
            require(cpus <= cores, "ray.cpus_per_shard", cpus,
                    f"this machine has {cores} CPU(s): a local Ray instance cannot give one shard more")
        # a local instance gets enough logical CPUs for the shards: they share the machine like inline shards do
        self.conn = ray_cluster.connect(ray_settings.address,
                                        num_cpus=max(os.cpu_count() or 1, math.ceil(n * cpus)),
                                        timeout_s=float(ray_settings.connect_timeout_s))
        try:
            algorithm = algorithm_for(settings, problem)
            cost = shard_costs(settings.seed, problem, algorithm.local_work, algorithm.batch_size)
            self.owned = balanced_ranges(cost, problem.num_clients, n)  # [lo, hi) per shard
            self.pg = ray_cluster.reserve(n, self.bundle, ray_settings.placement,
                                          float(ray_settings.reserve_timeout_s))
            self.actors = [self._spawn(s) for s in range(n)]
            self.infos = [self._check_ready(s, ray.get(a.ready.remote())) for s, a in enumerate(self.actors)]
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ actors

    def _spawn(self, s: int):
        options = {"num_cpus": self.bundle["CPU"], "num_gpus": self.bundle.get("GPU", 0),
                   "max_restarts": 0, "max_task_retries": 0,
                   "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=s)}
        actor = ray.remote(ShardActor).options(**options)
        return actor.remote(self.settings, self.owned[s], self.threads, self.plugins)

    def _check_ready(self, s: int, info: dict) -> dict:
        if info["error"] is not None:
            key, value, allowed = info["error"]
            raise ConfigError(key, value, f"{allowed} [on the node of client shard {s}, {info['host_ip']}]")
        mine = problem_fingerprint(self.problem)
        if tuple(info["fingerprint"]) != mine:
            raise ConfigError("dataset", self.settings.dataset.name,
                              f"client shard {s} on {info['host_ip']} built different data (num_clients, dim, "
                              f"dtype, sizes: {tuple(info['fingerprint'])} vs the driver's {mine}); every node "
                              "needs the same data_dir contents and package versions")
        return info

    def _respawn(self, s: int):
        """A fresh actor for shard s in its bundle (Ray moves the bundle if its node is gone)."""
        try:
            ray.kill(self.actors[s], no_restart=True)
        except Exception:  # already dead, or its node is gone
            pass
        self.restarts += 1
        actor = self._spawn(s)
        timeout = float(self.ray_settings.reserve_timeout_s)
        try:
            info = ray.get(actor.ready.remote(), timeout=timeout)
        except GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"client shard {s} could not be restarted within {timeout:g} s "
                               f"(ray.reserve_timeout_s): no node has room for its bundle {self.bundle}") from None
        self.infos[s] = self._check_ready(s, info)
        self.actors[s] = actor
        return actor

    def _recover(self, s: int, err: Exception, current: tuple | None = None) -> tuple[ShardResult, bool] | None:
        """Restart shard s, restore its clients' state, replay the rounds since the snapshot (and `current`)."""
        for _ in range(int(self.ray_settings.max_restarts)):
            try:
                actor = self._respawn(s)
                ray.get(actor.restore.remote(self._restore))
                for x_ref, plan_ref in self._history:
                    ray.get(actor.train.remote(x_ref, plan_ref))
                return None if current is None else ray.get(actor.train.remote(*current))
            except RECOVERABLE as again:
                err = again
        raise RuntimeError(f"client shard {s} failed and was restarted {self.ray_settings.max_restarts} time(s) "
                           f"(ray.max_restarts) without success; last error: {err}") from err

    def _call_all(self, method: str, *args) -> list:
        """Call `method` on every shard; shards whose actor died are recovered and called again."""
        calls = [getattr(a, method).remote(*args) for a in self.actors]
        out = []
        for s, call in enumerate(calls):
            try:
                out.append(ray.get(call))
            except RECOVERABLE as err:
                if method == "train":
                    out.append(self._recover(s, err, args))
                else:
                    self._recover(s, err)
                    out.append(ray.get(getattr(self.actors[s], method).remote(*args)))
        return out

    # ------------------------------------------------------------ executor contract

    def local_updates(self, x: torch.Tensor, plan: RoundPlan) -> ShardResult:
        x_ref = ray.put(x.detach().cpu())  # once per round; every shard gets the reference
        travel_by_value(plan.stages)  # a user's stage work from a module the shards cannot import
        plan_ref = ray.put(dataclasses.replace(plan, server_ctx={k: v.cpu() for k, v in plan.server_ctx.items()}))
        results = self._call_all("train", x_ref, plan_ref)
        total = ShardResult.zeros(x.detach().cpu(), plan, self.settings.sums == "exact")
        stateful = False
        for result, has_state in results:  # exact sums: the same bits in any order, and as one shard
            total.add(result)
            stateful = stateful or has_state
        if stateful:
            self._history.append((x_ref, plan_ref))
            if len(self._history) >= SNAPSHOT_EVERY:
                self._snapshot()
        return total.to(x.device)  # with an UpdateAggregator's raw updates (on the CPU), else []

    def _snapshot(self) -> None:
        """Each shard writes its slots changed since its last snapshot; the point a restarted shard resumes from.
        Once a restarted shard would read the files of COMPACT_AFTER snapshots (or a resume's checkpoint), each
        writes its whole table instead, and the snapshot files before it are deleted."""
        self._snapshot_round += 1
        full = len(self._restore) >= client_store.COMPACT_AFTER
        keys = self._call_all("checkpoint", self._snapshots, "snapshots", self._snapshot_round, "snapshot", full)
        written = (self._snapshots, [key for part in keys for key in part])
        self._restore = [written] if full else [*self._restore, written]
        self._history = []
        if full:
            store = open_store(self._snapshots)
            for key in set(store.list("snapshots")) - set(written[1]):
                store.delete(key)

    def checkpoint(self, results, prefix: str, rnd: int, every: bool = False) -> list[str]:
        return [key for part in self._call_all("checkpoint", results.url, prefix, rnd, "checkpoint", every)
                for key in part]

    def restore(self, results, keys: list[str]) -> None:
        self._restore, self._history = [(results.url, list(keys))], []
        self._call_all("restore", self._restore)

    def keep_replicas(self, rows: np.ndarray) -> None:
        self._call_all("keep_replicas", rows)
        self._restore = []  # the files before name the old rows: the snapshot after holds every row (all changed)
        self._snapshot()

    def client_scores(self, x: torch.Tensor, replicas: np.ndarray, clients: np.ndarray,
                      finetune: FineTune | None = None) -> ClientScores:
        x_ref = ray.put(x.detach().cpu())
        calls = {}
        for s, (lo, hi) in enumerate(self.owned):
            mine = clients[(clients >= lo) & (clients < hi)]
            if len(mine):
                calls[s] = self.actors[s].client_scores.remote(x_ref, replicas, mine, finetune)
        return merge_scores(clients, self.owned, lambda s, mine: ray.get(calls[s]))

    def get_state(self) -> dict:
        """Every kept slot value by (replica, client): for inspection (tests); the engine never asks."""
        return {key: value for part in self._call_all("get_state") for key, value in part.items()}

    def shard_nodes(self) -> list[str]:
        """The Ray node id each shard runs on."""
        return [info["node_id"] for info in self.infos]

    def shard_memory(self) -> list[dict[str, int]]:
        """Each shard process's peak resident bytes: at start (imports only) and so far."""
        return self._call_all("memory")

    def close(self) -> None:
        shutil.rmtree(self._snapshots, ignore_errors=True)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors, self._history = [], []
        if self.pg is not None:
            ray_cluster.release(self.pg)
            self.pg = None
        conn, self.conn = getattr(self, "conn", None), None
        if conn is not None:
            conn.close()
