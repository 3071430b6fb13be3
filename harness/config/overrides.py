"""Override text, written and read in one place: a value as Hydra reads it back, a mapping as overrides, a command
line split by config group (nested mappings: fedharness.base.mappings).

Every `key=value` the harness writes (the Python API's mappings, sweep grids, a tuning trial's parameters, a tuned
override file) goes through `format_value`, so a value always parses back to itself: the string "true" stays a
string, 1e-05 stays a float.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Mapping

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from fedharness.base.mappings import flatten

BARE = re.compile(r"[A-Za-z_][\w\-./]*")  # text Hydra reads as this very string when it is not one of READ_AS_OTHER
WORD = re.compile(r"[\w\-./]+")  # other text without spaces or quotes: bare where Hydra reads it back (2nn, 3d)
READ_AS_OTHER = ("true", "false", "null", "inf", "nan")  # bare, in any case, Hydra reads these as bool, None, float


def format_value(value: Any) -> str:
    """A value as Hydra override text that parses back to the same value (floats by repr: exact)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{format_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if (BARE.fullmatch(text) and text.lower() not in READ_AS_OTHER) or (WORD.fullmatch(text) and _reads_back(text)):
        return text  # bare where Hydra reads it back as this string: a config name such as 2nn stays 2nn
    return _quoted(text)


@functools.cache
def _parser() -> OverridesParser:
    return OverridesParser.create()


def _reads_back(text: str) -> bool:
    """Whether Hydra reads the bare text as this very string (not a number, bool, None, list, or an error)."""
    try:
        parsed = _parser().parse_override(f"key={text}").value()
    except HydraException:
        return False
    return isinstance(parsed, str) and parsed == text


def _quoted(text: str) -> str:
    """Single-quoted for Hydra: a quote is escaped, and so are the backslashes before a quote or the end (Hydra
    reads any other backslash as itself)."""
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"


def dict_overrides(data: Mapping[str, Any]) -> list[str]:
    """A mapping (nested or dotted keys) as Hydra overrides: {"algorithm": {"mu": 0.1}} -> ["algorithm.mu=0.1"]."""
    return [f"{k}={format_value(v)}" for k, v in flatten(data).items()]


def override_key(override: str) -> str:
    """The dotted key an override sets: `+tune.n_trials=3` -> `tune.n_trials`."""
    return override.lstrip("+~").partition("=")[0]


def split_overrides(overrides: list[str], group: str) -> tuple[str | None, list[str], list[str]]:
    """(the option `group=NAME` picks, None where none does; the `group.*` overrides as written; the rest)."""
    option, own, rest = None, [], []
    for ov in overrides:
        key = override_key(ov)
        if key == group:
            option = ov.partition("=")[2]
        elif key.startswith(group + "."):
            own.append(ov)
        else:
            rest.append(ov)
    return option, own, rest
