"""Markdown tables (no extra dependency) and number formatting that shows censoring instead of hiding it."""

from __future__ import annotations

import math

import pandas as pd


def fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int,)) and not isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if math.isinf(v):
            return "censored"
        if v == int(v) and abs(v) < 1e9:
            return str(int(v))
        return f"{v:.{digits}g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def table(df: pd.DataFrame, columns: list[str] | None = None, headers: dict[str, str] | None = None) -> str:
    columns = columns or list(df.columns)
    headers = headers or {}
    lines = ["| " + " | ".join(headers.get(c, c) for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in df[columns].itertuples(index=False):
        lines.append("| " + " | ".join(fmt(v.item() if hasattr(v, "item") else v) for v in row) + " |")
    return "\n".join(lines)
