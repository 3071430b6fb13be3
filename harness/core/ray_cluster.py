"""Start or join Ray, and reserve resources for client shards, with bounded waits and clear errors.

Used by the Ray executor (`executor=ray`) and by sweeps. Three rules:

* The embedded local instance listens on 127.0.0.1 only: Ray binds to the machine's
  primary address unless `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` is in force while it starts,
  so we set it (and restore it afterwards), pass `_node_ip_address=127.0.0.1` and keep the
  dashboard off. No port is open to the network.
* Joining a cluster never hangs: the address is probed (TCP, then a GCS handshake in a child
  process that is killed at the deadline) before `ray.init` is called, because `ray.init`
  on a wrong address waits minutes.
* Nothing here logs or returns credentials. A secured cluster takes its token and TLS files
  from Ray's own environment variables (docs/cluster.md); configs hold only host:port.

`ray` is imported lazily so that configs can be validated without paying for it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

from fedharness.errors import ConfigError, require

LOOPBACK = "127.0.0.1"
CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
PLACEMENTS = {"spread": "SPREAD", "pack": "PACK"}
_HOST_PORT = re.compile(r"^(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:]+\]):(?P<port>\d{1,5})$")


# ---------------------------------------------------------------- the address (no ray import)

def parse_address(address: Any) -> tuple[str, int] | str | None:
    """None (start a local instance), "auto" (the cluster this node belongs to) or (host, port).
    The config schema checks `ray.address` with it (harness/config/schema.py); the other `ray` keys are the schema's."""
    if address is None or address == "auto":
        return address
    text = str(address)
    if "@" in text or "://" in text:
        raise ConfigError("ray.address", "<hidden>" if "@" in text else text,
                          "host:port or auto; credentials never go in the config (docs/cluster.md: the token "
                          "comes from RAY_AUTH_TOKEN_PATH), and ray:// client addresses are not supported "
                          "(submit the driver as a Ray job instead)")
    m = _HOST_PORT.match(text)
    require(m is not None and 0 < int(m["port"]) < 65536, "ray.address", text,
            "null (start a local Ray on 127.0.0.1), auto, or host:port of a running cluster's GCS")
    return m["host"].strip("[]"), int(m["port"])


# ---------------------------------------------------------------- connecting

@dataclass
class Connection:
    """A driver's link to Ray; `owned` means this process started the instance and shuts it down."""

    address: str
    owned: bool
    local: bool

    def close(self) -> None:
        import ray

        if self.owned and ray.is_initialized():
            ray.shutdown()


@contextmanager
def loopback_only() -> Iterator[None]:
    """Make Ray (this process and the processes it spawns now) use 127.0.0.1 as the node address."""
    old = os.environ.get(CLUSTERS_ENV)
    os.environ[CLUSTERS_ENV] = "0"
    import ray._private.ray_constants as constants  # read at call time by services.get_node_ip_address

    old_flag = constants.ENABLE_RAY_CLUSTER
    constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        constants.ENABLE_RAY_CLUSTER = old_flag
        if old is None:
            os.environ.pop(CLUSTERS_ENV, None)
        else:
            os.environ[CLUSTERS_ENV] = old


def start_local(num_cpus: float | None = None, num_gpus: float | None = None,
                resources: dict[str, float] | None = None) -> Connection:
    """Start an embedded Ray on 127.0.0.1 (no dashboard) and connect this process to it. Its workers run at the
    driver's priority: Ray starts them at nice 15, where any other work on the machine takes nearly all of the CPU
    from the shards, which do the run's work (a 5-round Ray run took 183 s beside three busy processes, 12 s at
    nice 0)."""
    import ray

    with loopback_only():
        ctx = ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
                       include_dashboard=False, _node_ip_address=LOOPBACK, log_to_driver=False,
                       configure_logging=False, _system_config={"worker_niceness": 0})
    return Connection(ctx.address_info["gcs_address"], owned=True, local=True)


_GCS_PROBE = """
import sys
from ray._raylet import GcsClient
client = GcsClient(address=sys.argv[1])
client.internal_kv_get(b"fedharness-probe", None, timeout=float(sys.argv[2]))
"""


def is_loopback(host: str) -> bool:
    return host == "localhost" or host == "::1" or host.startswith("127.")


def probe_gcs(host: str, port: int, timeout_s: float) -> str | None:
    """None when a Ray GCS answers at host:port within timeout_s, else why not (no credentials in it)."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=min(5.0, timeout_s)):
            pass
    except OSError as err:
        return f"nothing accepts connections at {host}:{port} ({err.strerror or type(err).__name__})"
    left = max(1.0, deadline - time.monotonic())
    try:
        env = {**os.environ, **({CLUSTERS_ENV: "0"} if is_loopback(host) else {})}
        out = subprocess.run([sys.executable, "-c", _GCS_PROBE, f"{host}:{port}", str(left)],
                             capture_output=True, text=True, timeout=left + 2, env=env)
    except subprocess.TimeoutExpired:
        return f"{host}:{port} accepts connections but no Ray GCS answered within {timeout_s:g} s"
    if out.returncode == 0:
        return None
    last = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-1:] or ["no output"]
    if "uthenticat" in out.stderr:
        return (f"the Ray cluster at {host}:{port} refused this driver's credentials; set RAY_AUTH_TOKEN_PATH "
                f"(or RAY_AUTH_TOKEN) to the cluster's token (docs/cluster.md)")
    return f"no Ray GCS answered at {host}:{port} ({last[0][:200]})"


def connect(address: str | None = None, *, num_cpus: float | None = None, num_gpus: float | None = None,
            timeout_s: float = 20.0) -> Connection:
    """Use this process's Ray connection if it has one; else start a local instance or join `address`.

    Raises ConfigError naming `ray.address` when the cluster cannot be reached within `timeout_s`.
    """
    import ray

    if ray.is_initialized():
        return Connection(ray.get_runtime_context().gcs_address, owned=False,
                          local=ray.util.get_node_ip_address() == LOOPBACK)
    target = parse_address(address)
    if target is None:
        return start_local(num_cpus=num_cpus, num_gpus=num_gpus)
    if target == "auto":  # RAY_ADDRESS, else the cluster this node joined (`ray start`): then probed like host:port
        from ray._private.services import canonicalize_bootstrap_address

        try:
            found, why = canonicalize_bootstrap_address("auto"), "none is recorded"
        except ConnectionError as err:
            found, why = None, str(err)
        if found is None:
            raise ConfigError("ray.address", "auto", f"no running Ray cluster was found on this node ({why}); "
                              "start one with `ray start --head`, give host:port, or leave ray.address unset "
                              "for a local instance")
        target = parse_address(found)
    host, port = target
    why = probe_gcs(host, port, timeout_s)
    if why is not None:
        shown = f"{host}:{port}" if address != "auto" else f"auto (found {host}:{port})"
        raise ConfigError("ray.address", shown, f"{why}; start the head with `ray start --head "
                          "--port=PORT`, or leave ray.address unset for a local instance")
    with loopback_only() if is_loopback(host) else nullcontext():  # else Ray swaps 127.0.0.1 for the LAN address
        ctx = ray.init(address=f"{host}:{port}", log_to_driver=False, configure_logging=False)
    return Connection(ctx.address_info["gcs_address"], owned=False, local=is_loopback(host))


# ---------------------------------------------------------------- resources

def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def _largest(nodes: list[dict], resource: str) -> float:
    return max((n["Resources"].get(resource, 0.0) for n in nodes), default=0.0)


def check_fits(num_shards: int, bundle: dict[str, float]) -> None:
    """Fail fast with the resource's key when no node, or the whole cluster, can hold the shards."""
    import ray

    nodes = alive_nodes()
    total = ray.cluster_resources()
    keys = {"CPU": "ray.cpus_per_shard", "GPU": "ray.gpus_per_shard"}
    for resource, amount in bundle.items():
        largest = _largest(nodes, resource)
        key = keys.get(resource, "ray")
        require(amount <= largest, key, amount,
                f"no node of the cluster has {amount:g} {resource}; the largest node has {largest:g} {resource} "
                f"(cluster total {total.get(resource, 0.0):g} {resource})")
        have = total.get(resource, 0.0)
        require(num_shards * amount <= have + 1e-9, "ray.num_shards", num_shards,
                f"{num_shards} shards x {amount:g} {resource} = {num_shards * amount:g} {resource}, but the "
                f"cluster has {have:g} {resource} in all")


def reserve(num_shards: int, bundle: dict[str, float], placement: str, timeout_s: float):
    """A placement group of one bundle per shard, ready within `timeout_s`, or ConfigError naming the resource."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    check_fits(num_shards, bundle)
    pg = placement_group([dict(bundle) for _ in range(num_shards)], strategy=PLACEMENTS[placement])
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        free = ray.available_resources()
        have = ", ".join(f"{free.get(r, 0.0):g} {r}" for r in bundle)
        raise ConfigError("ray.num_shards", num_shards,
                          f"could not reserve {num_shards} x {bundle} ({placement}) within {timeout_s:g} s "
                          f"(ray.reserve_timeout_s); free now: {have}. Other work holds the rest, or "
                          f"placement=spread/pack cannot be met")
    return pg


def release(pg) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception:  # the cluster may already be gone; nothing left to free
        pass
