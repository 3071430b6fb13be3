"""The driver as the writer: Ray tasks record into the driver's results store, wherever they run.

A sweep point or a tuning trial runs as a Ray task on any node of a cluster. Nodes need not share a folder (most
cloud clusters have none), so a task must not write `results_dir` as a path on its own node. Instead the driver
starts one `ResultsWriter` actor on its own node, holding the store the driver opened (a relative `results_dir`
resolved against the driver's working directory), and hands the tasks a `DriverStore`: a ResultsStore whose every
call is applied by that actor. Each write waits for the actor, so an object is in the driver's store
when the call returns, whole (the store's write is whole or nothing): a driver killed mid-sweep keeps every row it
had received, and the objects a run writes land once each, under the keys the run names, as they would locally.

The actor lives as long as the driver's job: when the driver dies, the tasks' next write fails and nothing lands
anywhere else.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from fedharness.results import layout
from fedharness.results.store import ResultsStore

# Several tasks write at once (one per busy CPU of the cluster); the store's writes are independent objects
# (a temporary name each, then a rename), so the actor applies them on a few threads, not one at a time.
WRITER_THREADS = 8


class ResultsWriter:
    """The Ray actor on the driver's node that applies a DriverStore's calls to the driver's store."""

    def __init__(self, store: ResultsStore):
        self.store = store

    def write(self, key: str, data: bytes) -> None:
        self.store.write(key, data)

    def read(self, key: str) -> bytes | None:
        return self.store.read(key)

    def exists(self, key: str) -> bool:
        return self.store.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.store.list(prefix)

    def delete(self, key: str) -> None:
        self.store.delete(key)


class DriverStore:
    """A ResultsStore for Ray tasks: each call goes to the driver's ResultsWriter and returns once it is applied.
    Picklable (it holds the actor's handle), so it travels to tasks as an argument."""

    def __init__(self, url: str, writer):
        self.url = url  # the driver's results directory, as the user can name it again
        self.writer = writer

    def _call(self, method: str, *args):
        # Waited on as a future, not with ray.get: a task blocked in ray.get lends its CPU back to Ray, which then
        # starts the next task in a new worker process (seconds of imports each; measured: a new process per run
        # of a sweep). Either way the call has been applied when this returns, and its error is raised here.
        return getattr(self.writer, method).remote(*args).future().result()

    def write(self, key: str, data: bytes) -> None:
        self._call("write", key, data)

    def read(self, key: str) -> bytes | None:
        return self._call("read", key)

    def exists(self, key: str) -> bool:
        return self._call("exists", key)

    def list(self, prefix: str) -> list[str]:
        return self._call("list", prefix)

    def delete(self, key: str) -> None:
        self._call("delete", key)

    def __repr__(self) -> str:
        return f"DriverStore({self.url!r})"


def start_writer(store: ResultsStore) -> DriverStore:
    """Start the ResultsWriter on this process's node (the driver's; Ray connected) and return its DriverStore.
    The actor takes no CPU, so it never waits behind the tasks it serves."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(ResultsWriter).options(num_cpus=0, scheduling_strategy=here,
                                              max_concurrency=WRITER_THREADS, max_restarts=0)
    writer = actor.remote(store)
    remote = DriverStore(store.url, writer)
    remote.exists(layout.RUNS)  # started and answering before any task is sent (a start failure surfaces here)
    return remote


def stop_writer(remote: DriverStore) -> None:
    """End the actor (its calls have all returned: every caller waited for its own)."""
    import ray

    if ray.is_initialized():  # else the actor ended with the connection
        ray.kill(remote.writer, no_restart=True)


@contextmanager
def driver_store(store: ResultsStore) -> Iterator[DriverStore]:
    """`start_writer` for the length of a with-block."""
    remote = start_writer(store)
    try:
        yield remote
    finally:
        stop_writer(remote)
