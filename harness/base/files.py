"""Files written whole or not at all: a reader (or a crash) never sees half of one; and the cache's folder."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import BinaryIO, Callable


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """`write(f)` into a unique temporary name in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def cache_dir() -> Path:
    """$FEDHARNESS_CACHE (default ~/.cache/fedharness): what is kept between runs (exact references, kernel
    choices), never under a results_dir."""
    return Path(os.environ.get("FEDHARNESS_CACHE", Path.home() / ".cache" / "fedharness"))
