"""The vocabulary every config key is declared with: its check, what is allowed (for the one-line error) and a doc.

A part declares its own keys with these (next to its code); the schema, `fedharness run --help`, `fedharness config`
and the error messages are generated from the declarations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from fedharness.errors import ConfigError


@dataclass(frozen=True)
class Key:
    check: Callable[[Any], bool]
    allowed: str
    doc: str
    batchable: bool = False  # may differ between the slots of one batched run (fedharness.runs.batch)

    def require(self, key: str, value: Any) -> None:
        """ConfigError naming `key`, the value and what is allowed, unless `value` is allowed."""
        if not self.check(value):
            raise ConfigError(key, value, str(self.allowed))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _nullable(check: Callable[[Any], bool], allowed: str, null: str | None) -> tuple[Callable[[Any], bool], str]:
    if null is None:
        return check, allowed
    return (lambda v: v is None or check(v)), f"null ({null}) or {allowed}"


def _bounds(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> tuple[Callable, str]:
    def ok(v) -> bool:
        return ((lo is None or (v > lo if lo_open else v >= lo)) and (hi is None or (v < hi if hi_open else v <= hi)))

    if lo is not None and hi is not None:
        text = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        text = f"{'>' if lo_open else '>='} {lo:g}"
    else:
        text = f"{'<' if hi_open else '<='} {hi:g}" if hi is not None else ""
    return ok, text


def integer(doc: str, lo: int | None = None, hi: int | None = None, null: str | None = None,
            batchable: bool = False) -> Key:
    ok, text = _bounds(lo, hi, False, False)
    return Key(*_nullable(lambda v: _is_int(v) and ok(v), f"an integer {text}".rstrip(), null), doc, batchable)


def number(doc: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
           hi_open: bool = False, null: str | None = None, batchable: bool = False) -> Key:
    ok, text = _bounds(lo, hi, lo_open, hi_open)
    return Key(*_nullable(lambda v: _is_real(v) and ok(v), f"a finite number {text}".rstrip(), null), doc, batchable)


def boolean(doc: str) -> Key:
    return Key(lambda v: isinstance(v, bool), "true or false", doc)


def text(doc: str, null: str | None = None) -> Key:
    return Key(*_nullable(lambda v: isinstance(v, str) and v != "", "a non-empty string", null), doc)


def choice(doc: str, options: Iterable[str] | Callable[[], Iterable[str]], batchable: bool = False) -> Key:
    """One of `options`; a callable is read at validation time (live registries)."""
    names = options if callable(options) else (lambda fixed=tuple(options): fixed)

    class _Allowed(str):  # the message lists the registry as it is when the error is raised
        def __str__(self) -> str:
            return "one of: " + ", ".join(names())

    return Key(lambda v: isinstance(v, str) and v in tuple(names()), _Allowed(), doc, batchable)


def anything(doc: str) -> Key:
    return Key(lambda v: True, "anything", doc)


def _is_list(v: Any, item: Callable[[Any], bool]) -> bool:
    return isinstance(v, list) and all(item(x) for x in v)
