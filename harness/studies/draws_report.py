"""What `make reproduce` reports over the data draws of every claim: in how many draws each claim (and each part
of its criterion, studies/claims.py) holds, the spread of the numbers docs/reproductions.md quotes, the table in
docs/reproductions.md and the figure docs/reproductions/draws.png."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedharness.studies.claims import CRITERIA, headline

# The docs' summary table lives between these lines; `make reproduce` rewrites what is between them.
TABLE_BEGIN, TABLE_END = "<!-- draws: begin (written by make reproduce) -->", "<!-- draws: end -->"


def summarise(name: str, draws: list[dict], seeds: list) -> dict:
    """k of n draws where the claim holds, each part's count, and median / min / max of every quoted number."""
    parts = [CRITERIA[name](res) for res in draws]
    holds = [all(p.values()) for p in parts]
    numbers = [headline(name, res) for res in draws]
    spread = {}
    for key in numbers[0]:
        values = [n.get(key) for n in numbers]
        finite = [float(v) for v in values if v is not None and np.isfinite(v)]
        spread[key] = {"median": float(np.median(finite)) if finite else None,
                       "min": min(finite, default=None), "max": max(finite, default=None),
                       "values": [None if v is None else float(v) for v in values]}
    return {"n": len(draws), "k": sum(holds), "holds": holds, "seeds": seeds,
            "parts": {part: sum(p[part] for p in parts) for part in parts[0]}, "spread": spread}


def _in_order(name: str, s: dict) -> tuple[dict, dict]:
    """A claim's part counts and spreads in the order its criterion and headline give them (draw 0's): results.json
    is written with sorted keys, so a run of some claims (--only) reads the others' back sorted."""
    first = (s.get("results") or [None])[0]
    parts_order = list(CRITERIA[name](first)) if first else []
    spread_order = list(headline(name, first)) if first else []
    return ({**{k: s["parts"][k] for k in parts_order if k in s["parts"]}, **s["parts"]},
            {**{k: s["spread"][k] for k in spread_order if k in s["spread"]}, **s["spread"]})


def verdict(k: int, n: int) -> str:
    """A claim reproduces when it holds in most draws."""
    return "reproduces" if 2 * k > n else "does not reproduce"


def _number(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"


def docs_table(results: dict) -> str:
    """The markdown summary: per claim, k of n, the parts that failed in some draw, and every quoted number's
    median [min, max] over the draws."""
    lines = ["| claim | holds in k of n draws | verdict | parts that fail in some draw (held in) | numbers: median "
             "[min, max] over the draws |", "|---|---|---|---|---|"]
    for name, res in results.items():
        s = res.get("over_draws") if isinstance(res, dict) else None
        if not s:
            continue
        parts, spread = _in_order(name, s)
        failing = "; ".join(f"{p} ({c}/{s['n']})" for p, c in parts.items() if c < s["n"]) or "none"
        numbers = "; ".join(f"{k} {_number(v['median'])} [{_number(v['min'])}, {_number(v['max'])}]"
                            for k, v in spread.items())
        lines.append(f"| `{name}` | {s['k']} of {s['n']} | {verdict(s['k'], s['n'])} | {failing} | {numbers} |")
    return "\n".join(lines)


def write_docs_table(docs: Path, results: dict) -> None:
    """Replace the summary table between TABLE_BEGIN and TABLE_END in docs/reproductions.md."""
    text = docs.read_text()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        return
    head, rest = text.split(TABLE_BEGIN, 1)
    tail = rest.split(TABLE_END, 1)[1]
    docs.write_text(f"{head}{TABLE_BEGIN}\n{docs_table(results)}\n{TABLE_END}{tail}")


def draws_figure(results: dict, out: Path) -> str:
    """One panel per claim: every quoted number of every draw over its median (1 = the median draw), so the
    spread shows at a glance; the title says in how many draws the claim holds."""
    from matplotlib.figure import Figure

    claims = [(n, r["over_draws"]) for n, r in results.items() if isinstance(r, dict) and r.get("over_draws")]
    cols = 4
    rows = -(-len(claims) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows))
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (name, s) in zip(axes, claims):
        for x, (key, v) in enumerate(_in_order(name, s)[1].items()):
            values = [u for u in v["values"] if u is not None]
            if v["median"] and values:
                ax.plot([x] * len(values), np.array(values) / v["median"], "o", ms=3, alpha=0.6, color="C0")
        ax.axhline(1, color="k", lw=0.5)
        ax.set_xticks(range(len(s["spread"])))
        ax.set_xticklabels([str(i + 1) for i in range(len(s["spread"]))], fontsize=6)
        ax.set_title(f"{name}: holds in {s['k']} of {s['n']}", fontsize=9)
        ax.set_ylabel("value / median of draws", fontsize=7)
    for ax in axes[len(claims):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(out / "draws.png", dpi=90)
    return "draws.png"
