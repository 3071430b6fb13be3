"""The errors a user sees as one line: bad input (key, value, what is allowed) and results that cannot be written."""

from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """Bad configuration or bad data, detected before any work is done."""

    def __init__(self, key: str, value: Any, allowed: str | Iterable[str]):
        if not isinstance(allowed, str):
            allowed = "one of: " + ", ".join(sorted(str(a) for a in allowed))
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"invalid value for '{key}': {value!r} ({allowed})")


def require(condition: bool, key: str, value: Any, allowed: str) -> None:
    """Raise ConfigError unless `condition` holds."""
    if not condition:
        raise ConfigError(key, value, allowed)


class ResultsWriteError(OSError):
    """A write under results_dir failed (full disk, lost permission): one line for the user, not a traceback."""

    def __init__(self, results_dir: str, err: OSError):
        super().__init__(err.errno, f"cannot write results to '{results_dir}': {err.strerror or err}")


def raise_for_results_write(results_dir: str, err: OSError) -> None:
    """Re-raise `err` as ResultsWriteError when it concerns a file under `results_dir`; other OSErrors are bugs."""
    from pathlib import Path

    path = Path(err.filename).absolute() if err.filename else None
    if path is None or Path(results_dir).absolute() in (path, *path.parents):
        raise ResultsWriteError(results_dir, err) from err
