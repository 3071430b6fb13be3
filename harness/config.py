"""The run config: composed from conf/ and the overrides (harness/compose.py), a user's `_target_` parts
registered, then validated against the one schema (harness/schema.py)."""

from __future__ import annotations

from typing import Any

from fedharness.compose import compose_raw
from fedharness.schema import validate


def load_config(overrides: list[str], config_name: str = "config") -> dict[str, Any]:
    """Compose the config with overrides and validate it against harness/schema.py."""
    plain = compose_raw(overrides, config_name)
    if any("_target_" in (plain.get(s) or {}) for s in ("dataset", "partition", "model", "algorithm")):
        from fedharness.extend import register_targets  # a user's own parts, before validation names them

        register_targets(plain)
    validate(plain)
    return plain
