"""Shared test set-up: one torch thread (tests run beside other work), slow tests opt-in."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

torch.set_num_threads(1)
# The Ray clusters the tests start with `ray start` (and their workers) inherit this: Ray's default nice 15 leaves
# the shards ~3% of a core beside the other pytest worker, and a 5-round Ray test took 100 s instead of 11.
os.environ.setdefault("RAY_worker_niceness", "0")


@pytest.fixture(scope="session", autouse=True)
def _reference_cache(tmp_path_factory):
    """Tests share one exact-reference cache of their own, never the user's: one per test run, so that pytest-xdist's
    workers solve each reference once between them (the cache's entries are written atomically)."""
    run_root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each xdist worker has its own basetemp under the run's
        run_root = run_root.parent
    cache = run_root / "fedharness-cache"
    cache.mkdir(exist_ok=True)
    os.environ["FEDHARNESS_CACHE"] = str(cache)


# With the slow tests (CI), these files hold the longest work: pytest-xdist's --dist loadfile hands out files in
# collection order, so they start first and the short files fill the other worker meanwhile, instead of one of
# them starting last and running alone at the end (test_reproductions' claim draws: about 1,330 CPU s).
LONGEST_FIRST = ("test_reproductions.py", "test_same_bits.py", "test_attacks.py", "test_client_eval.py")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FEDHARNESS_SLOW") == "1":
        rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
        return
    skip = pytest.mark.skip(reason="slow test: run with FEDHARNESS_SLOW=1 (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


class _SharedRay:
    """This test process's one embedded Ray on 127.0.0.1 (4 CPUs: three shards of 1 CPU fit on this 2-core machine's
    instance, and a 3-CPU hog leaves less than two): started by the first module that asks for `local_ray` and kept
    for the next ones, since a start costs seconds. Each module gets it with every CPU free (else a fresh one, as
    when a test shut it down); modules that set OWN_RAY = True (their own clusters, or checks that no Ray is
    running) get it stopped first."""

    conn = None

    @classmethod
    def get(cls):
        import ray

        from fedharness.core import ray_cluster

        if cls.conn is not None and not (ray.is_initialized() and cls._all_free()):
            cls.stop()  # shut down by a test, or something of the last module still holds resources: a fresh one
        if cls.conn is None:
            cls.conn = ray_cluster.start_local(num_cpus=4)
        return cls.conn

    @staticmethod
    def _all_free(timeout_s: float = 20.0) -> bool:
        """Whether every resource of the instance is free within `timeout_s` (actors and reservations of the last
        module are released asynchronously)."""
        import ray

        from ray_support import eventually

        return eventually(lambda: ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"),
                          timeout_s, 0.25)

    @classmethod
    def stop(cls) -> None:
        if cls.conn is not None:
            cls.conn.close()
            cls.conn = None


@pytest.fixture(scope="module")
def local_ray():
    """The test process's embedded Ray on 127.0.0.1 (see _SharedRay)."""
    return _SharedRay.get()


@pytest.fixture(scope="module", autouse=True)
def _own_ray(request):
    """A module with OWN_RAY = True starts without the shared Ray (its tests start, join or rule out their own)."""
    if getattr(request.module, "OWN_RAY", False):
        _SharedRay.stop()


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_ray():
    yield
    _SharedRay.stop()


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server on 127.0.0.1 (tests/s3_support.py): CI's (FEDHARNESS_TEST_S3_URL), else moto's,
    started once per session."""
    import s3_support

    endpoint = os.environ.get("FEDHARNESS_TEST_S3_URL")
    server = contextlib.nullcontext(endpoint) if endpoint else s3_support.moto_server()
    with server as endpoint:
        yield s3_support.S3Server(endpoint)


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server, with the standard AWS_* variables pointing at it during the test."""
    import s3_support

    for name, value in s3_support.s3_env(s3_server.endpoint).items():
        monkeypatch.setenv(name, value)
    return s3_server


@pytest.fixture
def run_config(tmp_path):
    """Load a run's settings with overrides, results going to a temporary folder."""
    from fedharness.config.load import load_settings

    def load(*overrides: str):
        return load_settings([f"results_dir={tmp_path / 'results'}", "progress=false", *overrides])

    return load
