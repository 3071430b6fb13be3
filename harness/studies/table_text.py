"""The texts of a table spec (studies/tables.py): its labels, headings and cells.

A text is a template, `str.format` over a row's names (`{deadline_s:g}`; a name may hold dots, as config keys do;
a format spec starting with % formats 100 times the value: `{systems.slow_fraction:%g}`), or a list of parts
joined with nothing between them. A part is a text, or `{text: ..., when: {...}, unless: {...}}`: shown where
every name of `when` holds its value and not every name of `unless` does (a list of values: any of them; null: a
missing value or NaN). Two cells are named: `{to_target: NAME, digits: D}` ('mean ± std' of NAME over the seeds
that reached the target, or "not reached (> R)") and `{accuracy: WORD}` (the final test accuracy, or "diverged
after WORD R").
"""

from __future__ import annotations

import math
import string
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import pandas as pd

from fedharness.errors import ConfigError


class _Names(string.Formatter):
    """str.format with a field's whole name looked up (config keys hold dots) and '%' specs in percent."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        return kwargs[field_name], field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        if format_spec.startswith("%"):
            return format(100 * float(value), format_spec[1:])
        return format(value, format_spec)


_NAMES = _Names()


def _is(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, list):
        return any(_is(value, w) for w in wanted)
    if wanted is None:
        return value is None or (isinstance(value, float) and math.isnan(value))
    return value == wanted


def matches(names: Mapping[str, Any], condition: Mapping[str, Any]) -> bool:
    """Whether every name of `condition` holds its value (module doc)."""
    return all(_is(names.get(k), v) for k, v in condition.items())


def pm(mean: float, std: float, digits: int) -> str:
    """'mean ± std'; the mean alone where std is NaN (a single seed)."""
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def text(spec: Any, names: Mapping[str, Any]) -> str:
    """The text `spec` (module doc) of a row's `names`."""
    if isinstance(spec, str):
        try:
            return _NAMES.vformat(spec, (), names)
        except KeyError as err:  # a spec's typo: one line naming the template and what it may name
            raise ConfigError(f"table text {spec!r}", err.args[0], "a config key or one of: "
                              + ", ".join(str(n) for n in names if "." not in str(n))) from None
    if isinstance(spec, list):
        return "".join(text(part, names) for part in spec)
    if "to_target" in spec:
        name = spec["to_target"]
        if not names["reached"]:
            return f"not reached (> {names['last_round']})"
        return pm(names[f"{name}_mean"], names[f"{name}_std"], spec["digits"])
    if "accuracy" in spec:
        if names["diverged"]:
            return f"diverged after {spec['accuracy']} {names['last_round']}"
        return pm(names["acc_mean"], names["acc_std"], 1)
    shown = matches(names, spec.get("when", {})) and not (spec.get("unless") and matches(names, spec["unless"]))
    return text(spec["text"], names) if shown else ""


# ---------------------------------------------------------------- Markdown

class Part(Mapping):
    """A table's rows as a heading reads them: a column is its first row's value, `max.COLUMN` its largest and
    `all.COLUMN` its distinct values joined by ', '."""

    def __init__(self, part: pd.DataFrame, extra: dict[str, Any]):
        self.part, self.extra = part, extra

    def __getitem__(self, name: str) -> Any:
        if name in self.extra:
            return self.extra[name]
        how, _, column = name.partition(".")
        if how == "max" and column:
            return self.part[column].max()
        if how == "all" and column:
            return ", ".join(str(v) for v in dict.fromkeys(self.part[column]))
        return self.part[name].iloc[0]

    def __iter__(self) -> Iterator[str]:
        return iter(self.part.columns)

    def __len__(self) -> int:
        return len(self.part.columns)


def parts(spec: dict[str, Any], table: pd.DataFrame) -> Iterator[tuple[Part, pd.DataFrame]]:
    """Each Markdown table's rows: by the `tables` keys in order of appearance, or, where `titles` is given, in its
    order, those only (the title is the heading's `title`)."""
    by, titles = spec["tables"]["by"], spec["tables"].get("titles")
    if titles is None:
        for _, part in table.groupby(by, sort=False):
            yield Part(part, {}), part
        return
    for value, title in titles.items():
        part = table[table[by] == value]
        if len(part):
            yield Part(part, {"title": title}), part


def header(names: list[str], right: list[bool]) -> list[str]:
    return ["| " + " | ".join(names) + " |", "|" + "".join("---:|" if r else "---|" for r in right)]


def axis(spec: dict[str, Any], table: pd.DataFrame) -> list[tuple]:
    """A pivot axis' values: the distinct tuples of its fields in `table` whose every value is in its `rank`, in
    those ranks' order."""
    fields = [k["field"] for k in spec["keys"]]
    present = dict.fromkeys(zip(*(table[f] for f in fields)))
    ranks = [k["rank"] for k in spec["keys"]]
    kept = [v for v in present if all(x in rank for x, rank in zip(v, ranks))]
    return sorted(kept, key=lambda v: [rank.index(x) for x, rank in zip(v, ranks)])


MISSING: Mapping[str, float] = defaultdict(lambda: math.nan)  # a pivot cell no seed fills: every statistic NaN


def pivot(spec: dict[str, Any], table: pd.DataFrame, part: pd.DataFrame) -> tuple[list[tuple], list[tuple], dict]:
    """The rows of `part` and the columns of the whole `table` of a pivot spec, and the cells by (row, column)."""
    p = spec["pivot"]
    rows, columns = axis(p["rows"], part), axis(p["columns"], table)
    fields = [k["field"] for k in p["rows"]["keys"]] + [k["field"] for k in p["columns"]["keys"]]
    cells = {tuple(r[f] for f in fields): r for r in part.to_dict("records")}
    return rows, columns, cells


def markdown(spec: dict[str, Any], table: pd.DataFrame) -> str:
    """One Markdown table per `tables` part: its heading, then a row per cell and the spec's `columns`, or (a
    `pivot`) a row per value of the rows' fields and a column per value of the columns' fields."""
    out = []
    for names, part in parts(spec, table):
        out += [text(spec["tables"]["heading"], names), ""]
        if "pivot" in spec:
            p = spec["pivot"]
            rows, columns, cells = pivot(spec, table, part)
            labels = [text(p["columns"]["label"], dict(zip([k["field"] for k in p["columns"]["keys"]], c)))
                      for c in columns]
            out += header([p["rows"]["header"], *labels], [False] + [True] * len(labels))
            for r in rows:
                values = [text(p["cell"], cells.get(r + c, MISSING)) for c in columns]
                out.append(f"| {' | '.join(map(str, r))} | " + " | ".join(values) + " |")
        else:
            cols = spec["columns"]
            out += header([c["header"] for c in cols], [c.get("align") == "right" for c in cols])
            for r in part.to_dict("records"):
                out.append("| " + " | ".join(text(c["cell"], r) for c in cols) + " |")
        out.append("")
    return "\n".join(out)
