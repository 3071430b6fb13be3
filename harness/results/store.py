"""Where results live: a folder on this machine, an object store, or the driver of a Ray job.

Everything fedharness records under a `results_dir` (runs/, rounds/, trials/, checkpoints/, sweep manifests) goes
through one `ResultsStore`, addressed by keys: POSIX paths relative to the results directory, such as
`runs/run_id=X/run.parquet` (harness/results/layout.py names them). A write is whole or nothing: a reader (or a
crash) never sees half an object.

* `FileStore`: a local folder (temporary name, fsync, rename).
* `ArrowStore`: an object store (`s3://bucket/prefix`, `gs://bucket/prefix`) through pyarrow's file systems (one
  PUT per object, which object stores make atomic). Credentials come only from the standard places (AWS_* or
  GOOGLE_APPLICATION_CREDENTIALS variables, ~/.aws, instance roles), never from the URL; an S3-compatible
  store's endpoint from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (pyarrow alone reads neither);
* a store that forwards every call to the driver's store through Ray (fedharness.backends.results_writer), so
  a task on a node without the driver's folder still records there.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import urlsplit

from fedharness.errors import ConfigError, require
from fedharness.base.files import atomic_write
from fedharness.results import layout

OBJECT_STORES = ("s3", "gs")  # URL schemes results_dir takes besides a folder


@runtime_checkable
class ResultsStore(Protocol):
    """Whole objects under one root, by key (a relative POSIX path)."""

    url: str  # the results directory as the user can name it again: an absolute path or a URL

    def write(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, replacing what was there; whole or not at all."""

    def read(self, key: str) -> bytes | None:
        """The object's bytes; None when there is none."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> list[str]:
        """The keys of the objects under the folder `prefix` (recursively), sorted; [] when none."""

    def delete(self, key: str) -> None:
        """Remove the object; nothing happens when there is none."""


class FileStore:
    """A folder on this machine."""

    def __init__(self, root: str | Path):
        self.root = Path(root).absolute()
        self.url = str(self.root)

    def path(self, key: str) -> Path:
        return self.root / key

    def write(self, key: str, data: bytes) -> None:
        atomic_write(self.path(key), lambda f: f.write(data))  # a temporary name, fsync, rename

    def read(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        folder = self.path(prefix)
        if not folder.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in folder.rglob("*")
                      if p.is_file() and not p.name.startswith("."))  # hidden: a write in progress

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"


class ArrowStore:
    """An object store through a pyarrow file system: keys are objects under `<bucket>/<prefix>/`."""

    def __init__(self, url: str, filesystem, root: str):
        """`url`: as the user names it (s3://bucket/prefix); `root`: the same as the file system's path."""
        self.url, self.fs, self.root = url, filesystem, root

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def write(self, key: str, data: bytes) -> None:
        with self.fs.open_output_stream(self.path(key)) as f:  # the object appears at close, whole
            f.write(data)

    def read(self, key: str) -> bytes | None:
        try:
            with self.fs.open_input_stream(self.path(key)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        from pyarrow.fs import FileType

        return self.fs.get_file_info(self.path(key)).type == FileType.File

    def list(self, prefix: str) -> list[str]:
        from pyarrow.fs import FileSelector, FileType

        infos = self.fs.get_file_info(FileSelector(self.path(prefix), recursive=True, allow_not_found=True))
        return sorted(i.path[len(self.root) + 1:] for i in infos
                      if i.type == FileType.File and not i.base_name.startswith("."))

    def delete(self, key: str) -> None:
        try:
            self.fs.delete_file(self.path(key))
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"ArrowStore({self.url!r})"


class WriteBehind:
    """A store whose writes wait on the disk together: each write (whole, as the store makes it: a temporary name,
    fsync, rename) goes on in a background thread, so a batch's many small objects (every slot's runs/ row and
    rounds/ part) do not wait for the disk one after another. The writes of one run (its keys under run_id=<id>)
    land in the order they were made, as do those of any one key; a read, listing, existence check or delete first
    waits for every write before it; `drain()` waits for all and raises the first error. Only writes of different
    runs may land in another order than they were made."""

    def __init__(self, store: ResultsStore, threads: int = 8):
        self.store, self.url = store, store.url
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fedharness-write")
        self._last: dict[str, Future] = {}  # each run's (or key's) latest write

    def write(self, key: str, data: bytes) -> None:
        group = layout.run_of(key) or key
        self._last[group] = self._pool.submit(_write_after, self._last.get(group), self.store, key, data)

    def drain(self) -> None:
        pending, self._last = list(self._last.values()), {}
        errors = [error for error in (future.exception() for future in pending) if error is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Drain, then stop the threads."""
        try:
            self.drain()
        finally:
            self._pool.shutdown()

    def read(self, key: str) -> bytes | None:
        self.drain()
        return self.store.read(key)

    def exists(self, key: str) -> bool:
        self.drain()
        return self.store.exists(key)

    def list(self, prefix: str) -> list[str]:
        self.drain()
        return self.store.list(prefix)

    def delete(self, key: str) -> None:
        self.drain()
        self.store.delete(key)

    def __repr__(self) -> str:
        return f"WriteBehind({self.store!r})"


def _write_after(before: Future | None, store: ResultsStore, key: str, data: bytes) -> None:
    """store.write(key, data) once the write before it (of the same run) has ended. A pool takes its tasks in
    order, so `before` is running or done by the time this one runs: waiting on it cannot deadlock."""
    if before is not None:
        before.exception()  # waits; its error is drain's to raise
    store.write(key, data)


def write_behind(store: ResultsStore) -> WriteBehind | None:
    """A WriteBehind over a folder or an object store (None for another store, such as the Ray driver's)."""
    return WriteBehind(store) if isinstance(store, (FileStore, ArrowStore)) else None


def _scheme(results_dir: str) -> str | None:
    """The URL scheme of `results_dir` (None for a folder)."""
    scheme, sep, _ = results_dir.partition("://")
    return scheme.lower() if sep and scheme.isalnum() else None


def _object_root(url: str) -> tuple[str, str]:
    """s3://bucket/prefix or gs://bucket/prefix as (scheme, bucket/prefix); the URL holds no credentials, query
    or fragment."""
    parts = urlsplit(url)
    allowed = f"a folder, or an object store as {' or '.join(f'{s}://bucket/prefix' for s in OBJECT_STORES)}"
    require(parts.scheme in OBJECT_STORES, "results_dir", url, allowed)
    require("@" not in parts.netloc, "results_dir", f"{parts.scheme}://...@{parts.netloc.rpartition('@')[2]}"
            f"{parts.path}", "a URL without credentials: they come from the standard environment variables or "
            "files (docs/cluster.md)")
    require(bool(parts.netloc) and not parts.query and not parts.fragment, "results_dir", url, allowed)
    return parts.scheme, parts.netloc + ("/" + parts.path.strip("/") if parts.path.strip("/") else "")


def _s3_filesystem():
    """S3, or an S3-compatible store at AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL; region from AWS_REGION or
    AWS_DEFAULT_REGION, credentials by the AWS SDK's own chain."""
    from pyarrow.fs import S3FileSystem

    # delayed open: an object up to one part is a single PutObject at close
    options: dict = {"allow_delayed_open": True, "connect_timeout": 10, "request_timeout": 60}
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        endpoint = os.environ.get(name)
        if endpoint:
            parts = urlsplit(endpoint)
            require(parts.scheme in ("http", "https") and bool(parts.hostname) and "@" not in parts.netloc, name,
                    endpoint if "@" not in parts.netloc else "(hidden: it holds credentials)",
                    "an endpoint such as http://127.0.0.1:9000 or https://s3.example.org")
            options.update(endpoint_override=parts.netloc + parts.path.rstrip("/"), scheme=parts.scheme)
            break
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return S3FileSystem(**options)


def _gcs_filesystem():
    """Google Cloud Storage with Google's default credentials."""
    from pyarrow.fs import GcsFileSystem

    return GcsFileSystem()


def store_url(results_dir: str | Path) -> str:
    """The url of the store `results_dir` names (an absolute path, or the object store's URL), checked as
    open_store checks it, without opening it."""
    text = str(results_dir)
    if _scheme(text) is None:
        return str(Path(results_dir).absolute())
    scheme, root = _object_root(text)
    return f"{scheme}://{root}"


def open_store(results_dir: str | Path) -> ResultsStore:
    """The store a `results_dir` names: an object store for an s3:// or gs:// URL, else a local folder
    (relative to the working directory). A URL of another scheme, or holding credentials, is a ConfigError.
    A command opens it once and hands it down (fedharness.runs.lifecycle.open_results)."""
    text = str(results_dir)
    if _scheme(text) is None:
        return FileStore(results_dir)
    scheme, root = _object_root(text)
    filesystem = _s3_filesystem() if scheme == "s3" else _gcs_filesystem()
    return ArrowStore(f"{scheme}://{root}", filesystem, root)


def check_writable(store: ResultsStore) -> None:
    """For an object store, write and delete a small probe object, so that a bucket that does not exist or
    credentials it refuses stop a command before any run starts, as a ConfigError naming results_dir. (A
    folder is checked by the config's rules, harness/config/schema.py, without creating anything.)"""
    if not isinstance(store, ArrowStore):
        return
    key = layout.probe_key(uuid.uuid4().hex)
    try:
        store.write(key, b"")
        store.delete(key)
    except OSError as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError("results_dir", store.url, f"an object store fedharness can write to; writing a probe "
                          f"object failed: {first}") from None
