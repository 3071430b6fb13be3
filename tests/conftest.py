"""Shared test set-up: one torch thread (tests run beside other work), slow tests opt-in."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

torch.set_num_threads(1)


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


def pytest_collection_modifyitems(config, items):
    if os.environ.get("FEDHARNESS_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow test: run with FEDHARNESS_SLOW=1 (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def local_ray(request):
    """One embedded Ray on 127.0.0.1 for a module's tests, with the module's RAY_CPUS (default 4: three shards of
    1 CPU fit on this 2-core machine's instance); stopped after the module."""
    from fedharness.core import ray_cluster

    conn = ray_cluster.start_local(num_cpus=getattr(request.module, "RAY_CPUS", 4))
    yield conn
    conn.close()


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
