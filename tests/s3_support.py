"""An S3-compatible server on 127.0.0.1 for the object-store tests: the real pyarrow S3 client over HTTP, no mock.

CI's .ci/s3.sh starts one and exports FEDHARNESS_TEST_S3_URL (its endpoint, http://127.0.0.1:PORT); without it
the tests start moto's server themselves (`python -m moto.server`, from the `test` extra). When neither can be
had the S3 tests skip, unless FEDHARNESS_REQUIRE_S3=1 (CI), which makes that a failure.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import pytest

# Dummy credentials: moto accepts any; the tests check these never reach a result, log or message.
ACCESS_KEY = "AKIAFEDHARNESSTEST01"
SECRET_KEY = "fedharness-test-secret-" + "9f3c2b7a51d04e6e"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3 server on a free loopback port; yields its endpoint URL. `env`: extra variables for it (e.g.
    INITIAL_NO_AUTH_ACTION_COUNT=0, which makes it refuse every unknown access key)."""
    if importlib.util.find_spec("moto") is None:
        unavailable("no S3-compatible server: moto[server] (the `test` extra) is not installed")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto.server did not start: {proc.stderr.read()[-2000:]}")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT

    def filesystem(self, **options):
        from pyarrow.fs import S3FileSystem

        host = self.endpoint.split("://", 1)[1]
        return S3FileSystem(endpoint_override=host, scheme="http", region="us-east-1", access_key=ACCESS_KEY,
                            secret_key=SECRET_KEY, **options)

    def new_bucket(self) -> str:
        """A fresh, empty bucket (one per test: tests never see each other's objects)."""
        name = f"fh-{uuid.uuid4().hex[:12]}"
        self.filesystem(allow_bucket_creation=True).create_dir(name)
        return name

    def keys(self, bucket: str) -> list[str]:
        """Every object in the bucket (not the empty folder markers pyarrow leaves)."""
        from pyarrow.fs import FileSelector, FileType

        infos = self.filesystem().get_file_info(FileSelector(bucket, recursive=True))
        return sorted(i.path[len(bucket) + 1:] for i in infos if i.type == FileType.File)

    def read(self, bucket: str, key: str) -> bytes:
        with self.filesystem().open_input_stream(f"{bucket}/{key}") as f:
            return f.read()


def s3_env(endpoint: str) -> dict[str, str]:
    """What a user sets for an S3-compatible store: its endpoint, credentials and region, by the standard names."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def unavailable(reason: str):
    """Skip, or fail when CI requires the S3 tests (FEDHARNESS_REQUIRE_S3=1)."""
    if os.environ.get("FEDHARNESS_REQUIRE_S3") == "1":
        pytest.fail(f"the S3 tests are required (FEDHARNESS_REQUIRE_S3=1): {reason}")
    pytest.skip(reason)
