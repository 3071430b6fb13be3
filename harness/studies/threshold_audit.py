"""Issue 35's threshold audit: every threshold of studies/claims.py says what it separates (a claims.Boundary: the
value the paper's claim predicts, the alternative it rules out and that alternative's value), and the audit checks
that the threshold lies strictly between the two predictions. Whether it does depends on the papers alone, never on
a run; the observed values (docs/reproductions/results.json) are listed beside each threshold, with the draws on
the claim's side, for the reader.

Issue 30's rule (no threshold within 20% of its observed value) had one remedy, moving a threshold after seeing the
data; this one has none but reading the paper again. Orderings (A ends below B), exact identities and counts have
no threshold and are not listed; tests/test_reproductions.py asserts the criteria of claims.py and closed forms.

    python -m fedharness.studies.threshold_audit      # rewrite the table in docs/reproductions.md (make reproduce
                                                      # does too)
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from fedharness.studies import claims as C

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "reproductions" / "results.json"
DOCS = RESULTS.parent.parent / "reproductions.md"
TABLE_BEGIN, TABLE_END = "<!-- thresholds: begin (python -m fedharness.studies.threshold_audit) -->", \
    "<!-- thresholds: end -->"


@dataclass(frozen=True)
class Threshold:
    """Where one claims.Boundary is used: the claim whose results it reads, its name in claims.py, what is compared
    and the values one draw compares with it."""

    claim: str
    boundary: str
    compared: str
    values: Callable[[dict], list[float]]

    @property
    def bound(self) -> C.Boundary:
        return C.BOUNDARIES[self.boundary]


def separates(b: C.Boundary) -> bool:
    """The threshold lies strictly between what the claim predicts and what the alternative predicts."""
    return min(b.claim, b.alternative) < b.value < max(b.claim, b.alternative)


def on_claims_side(b: C.Boundary, value: float) -> bool:
    """Whether an observed value lies on the claim's side of the threshold."""
    return (value < b.value) == (b.claim < b.value)


def _mangold(res: dict, data: str, key: str) -> list[float]:
    return [res[data][H][key] for H in ("H=10", "H=100")]


def _table2_round_ratios(res: dict) -> list[float]:
    rows = {(r["iid"], r["model"], r["workers"], r["algorithm"]): r for r in res["rows"]}
    return [rows[(*k[:3], "scaffold")]["rounds"] / r["rounds"] for k, r in rows.items()
            if k[3] == "fedavg" and r["rounds"] and rows[(*k[:3], "scaffold")]["rounds"]]


def _per_unit_ratio(res: dict) -> list[float]:
    per_unit = res["constant_over_E_minus_1_eta"]
    return [max(per_unit) / min(per_unit)]


def _slope(path: tuple[str, ...]) -> Callable[[dict], list[float]]:
    def values(res: dict) -> list[float]:
        for key in path:
            res = res[key]
        return [] if res["slope"] is None else [res["slope"]]
    return values


THRESHOLDS: list[Threshold] = [
    Threshold("li_schemes", "RISE_OF_INITIAL", "scheme II rise after round 10 / initial, Synthetic(0,0)",
              lambda r: [r["synthetic(0,0)"]["fedavg_scheme_ii"]["rise_after"]]),
    Threshold("li_schemes", "RISE_OF_INITIAL", "scheme II rise after round 10 / initial, Synthetic(1,1)",
              lambda r: [r["synthetic(1,1)"]["fedavg_scheme_ii"]["rise_after"]]),
    Threshold("li_schemes_mnist", "RISE_OF_INITIAL", "unbalanced: scheme II rise after round 10 / initial",
              lambda r: [r["unbalanced"]["fedavg_scheme_ii"]["rise_after"]]),
    Threshold("li_schemes_mnist", "NEARLY_THE_SAME", "balanced: \\|scheme I / scheme II - 1\\|",
              lambda r: [abs(r["balanced"]["fedavg"]["final_loss"] / r["balanced"]["fedavg_scheme_ii"]["final_loss"]
                             - 1)]),
    Threshold("li_clients", "NEARLY_THE_SAME", "relative spread of the final losses across K",
              lambda r: [r["relative_spread"]]),
    Threshold("li_toy", "REACHES_OPTIMUM", "E = 1: \\|\\|w - w*\\|\\|", lambda r: [r["constant"][0]]),
    Threshold("li_toy", "FLOOR_PROPORTIONAL", "floor / ((E - 1) eta): max / min over E = 2, 5, 10", _per_unit_ratio),
    Threshold("li_toy", "DECAY_GOES_ON", "decaying / constant step, E = 2, 5, 10",
              lambda r: [d / c for d, c in zip(r["decaying"][1:], r["constant"][1:])]),
    Threshold("yang_speedup", "SPEEDUP_SLOWEST", "slope of rounds to target in n", _slope(("FedAvg",))),
    Threshold("yang_speedup", "SPEEDUP_FASTEST", "slope of rounds to target in n", _slope(("FedAvg",))),
    Threshold("yang_table2", "ABOUT_THE_SAME_FEWEST", "SCAFFOLD / FedAvg rounds, every row", _table2_round_ratios),
    Threshold("yang_table2", "ABOUT_THE_SAME_MOST", "SCAFFOLD / FedAvg rounds, every row", _table2_round_ratios),
    *[Threshold("qu_speedup", b, f"{kind} {alg} slope in K", _slope((key, alg)))
      for kind, key, alg in (("strongly convex", "strongly_convex", "FedAvg"),
                             ("strongly convex", "strongly_convex", "Nesterov FedAvg"),
                             ("overparameterized", "overparameterized", "FedAvg"))
      for b in ("SPEEDUP_SLOWEST", "SPEEDUP_FASTEST")],
    Threshold("mangold", "SCAFFOLD_SUPPRESSES", "SCAFFOLD / FedAvg averaged error, heterogeneous, H = 10 and 100",
              lambda r: _mangold(r, "mangold_heterogeneous", "scaffold_over_fedavg_average")),
    Threshold("mangold", "SCAFFOLD_FAILS", "SCAFFOLD / FedAvg averaged error, noisy, H = 10 and 100",
              lambda r: _mangold(r, "mangold_noisy", "scaffold_over_fedavg_average")),
    *[Threshold("mangold_bias", b, f"FedAvg bias slope in {x}", lambda r, k=key: [r[k]])
      for x, key in (("gamma", "fedavg_slope_in_gamma"), ("H - 1", "fedavg_slope_in_H_minus_1"))
      for b in ("FIRST_ORDER_LEAST", "FIRST_ORDER_MOST")],
    *[Threshold("mangold_bias", b, "RR bias slope in gamma", lambda r: [r["rr_slope_in_gamma"]])
      for b in ("SECOND_ORDER_LEAST", "SECOND_ORDER_MOST")],
    Threshold("wang_quadratic", "STALL_FACTOR", "min(FedAvg, FedProx) / FedNova distance, fixed and random tau",
              lambda r: [min(r[w]["fedavg"], r[w]["fedprox"]) / r[w]["fednova"]
                         for w in ("per_client", "gaussian_steps")]),
]


def audit(results: dict) -> list[dict]:
    """Every threshold: whether it separates its claim from the alternative, and over the draws the value nearest
    it in each draw and in how many draws that value lies on the claim's side."""
    rows = []
    for t in THRESHOLDS:
        draws = ((results.get(t.claim) or {}).get("over_draws") or {}).get("results") or []
        b = t.bound
        nearest = [min(vs, key=lambda v: abs(v - b.value)) for vs in map(t.values, draws) if vs]
        rows.append({"threshold": t, "separates": separates(b), "nearest": nearest,
                     "claims_side": sum(on_claims_side(b, v) for v in nearest)})
    return rows


def _g(v: float) -> str:
    return "inf" if v == float("inf") else f"{v:.3g}"


def docs_table(rows: list[dict]) -> str:
    lines = ["| claim | threshold (claims.py) | compared | the claim predicts | rules out | threshold | separates | "
             "value nearest the threshold: median [per draw] | draws on the claim's side |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, b = r["threshold"], r["threshold"].bound
        observed = f"{_g(float(np.median(r['nearest'])))} [{', '.join(_g(v) for v in r['nearest'])}]" \
            if r["nearest"] else "not run"
        lines.append(f"| `{t.claim}` | `{t.boundary}` | {t.compared} | {_g(b.claim)}: {b.words} | {b.rules_out}: "
                     f"{_g(b.alternative)} | {_g(b.value)} | {'yes' if r['separates'] else 'NO'} | {observed} | "
                     f"{r['claims_side']} of {len(r['nearest'])} |")
    return "\n".join(lines)


def write_docs(docs: Path, results: dict) -> list[dict]:
    """Rewrite the table between TABLE_BEGIN and TABLE_END (`make reproduce` does, after its runs)."""
    rows = audit(results)
    text = docs.read_text()
    if TABLE_BEGIN in text and TABLE_END in text:
        head, rest = text.split(TABLE_BEGIN, 1)
        docs.write_text(f"{head}{TABLE_BEGIN}\n{docs_table(rows)}\n{TABLE_END}{rest.split(TABLE_END, 1)[1]}")
    return rows


def main() -> int:
    rows = write_docs(DOCS, json.loads(RESULTS.read_text()))
    broken = [r for r in rows if not r["separates"]]
    print(f"{len(rows)} thresholds, {len(broken)} not strictly between the claim's and the alternative's prediction")
    for r in broken:
        print(f"  {r['threshold'].boundary} ({r['threshold'].claim}): {r['threshold'].compared}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
