"""Where results live: a folder on this machine, an object store, or the driver of a Ray job.

Everything fedharness records under a `results_dir` (runs/, rounds/, trials/, checkpoints/, sweep manifests) goes
through one `ResultsStore`, addressed by keys: POSIX paths relative to the results directory, such as
`runs/run_id=X/run.parquet`. A write is whole or nothing: a reader (or a crash) never sees half an object.

* `FileStore`: a local folder (temporary name, fsync, rename).
* object stores (`s3://bucket/prefix`, `gs://...`) through pyarrow's file systems (one PUT per object,
  which object stores make atomic);
* a store that forwards every call to the driver's store through Ray (fedharness.backends.results_writer), so
  a task on a node without the driver's folder still records there.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Protocol, runtime_checkable


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
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

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


def open_store(results_dir: str | Path) -> ResultsStore:
    """The store a `results_dir` names: a local folder (relative to the working directory) for now."""
    return FileStore(results_dir)
