"""Nested mappings (a config, a checkpoint's recorded config) as dotted keys: flattened, merged and compared. Here,
in the lowest layer, so that a checkpoint (core) and a batch (runs) compare configs with the one function."""

from __future__ import annotations

import copy
from typing import Any, Mapping


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys: {"algorithm": {"mu": 0.1}} -> {"algorithm.mu": 0.1}; an empty mapping is a
    value of its own."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every key whose value differs between two configs, in key order."""
    a, b = flatten(old), flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def merged(defaults: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` over `defaults`, a new mapping (neither is changed, nor shared): mappings merge key by key, anything
    else (lists too) replaces."""
    out = copy.deepcopy(dict(defaults))
    for k, v in values.items():
        both = isinstance(out.get(k), Mapping) and isinstance(v, Mapping)
        out[k] = merged(out[k], v) if both else copy.deepcopy(v)
    return out
