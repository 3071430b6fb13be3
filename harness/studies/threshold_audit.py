"""Issue 30's threshold audit: every threshold of studies/claims.py and tests/test_reproductions.py beside the values
it is compared with over the data draws (docs/reproductions/results.json), and its margin.

The rule (issue 30): no threshold may sit within 20% of the value it was observed at, unless the paper gives that
number. The margin of a threshold is |threshold - value| / |value|, taken at the value nearest the threshold among
those one draw compares (e.g. the four cells of a figure); a criterion that `make reproduce` judges over every draw
is read at the median draw's value, an assertion of a test that runs draw 0 at draw 0's. Orderings (A ends below
B), exact identities and counts have no threshold and are not listed.

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

RULE = 0.2  # the smallest margin a threshold the paper does not give may have
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "reproductions" / "results.json"
DOCS = RESULTS.parent.parent / "reproductions.md"
TABLE_BEGIN, TABLE_END = "<!-- thresholds: begin (python -m fedharness.studies.threshold_audit) -->", \
    "<!-- thresholds: end -->"


@dataclass(frozen=True)
class Threshold:
    """One threshold: the claim whose results it reads, where it is asserted (claims.NAME: over every draw; a test:
    draw 0), what is compared, the paper's words or figure it comes from, the threshold (two bounds for a band),
    whether the paper gives the number, and the values one draw compares with it."""

    claim: str
    where: str
    compared: str
    source: str
    threshold: tuple[float, ...] | Callable[[], tuple[float, ...]]  # a callable: computed when audited
    paper_gives: bool
    values: Callable[[dict], list[float]]

    def bounds(self) -> tuple[float, ...]:
        return self.threshold() if callable(self.threshold) else self.threshold


def _ratios(cells: list[tuple[float, float]]) -> list[float]:
    return [a / b for a, b in cells]


def _mangold(res: dict, data: str, key: str, Hs=("H=10", "H=100")) -> list[float]:
    return [res[data][H][key] for H in Hs]


def _table2_round_ratios(res: dict) -> list[float]:
    rows = {(r["iid"], r["model"], r["workers"], r["algorithm"]): r for r in res["rows"]}
    return [rows[(*k[:3], "scaffold")]["rounds"] / r["rounds"] for k, r in rows.items()
            if k[3] == "fedavg" and r["rounds"] and rows[(*k[:3], "scaffold")]["rounds"]]


def _slope(n: list[int], rounds: list[float], keep: set[int]) -> float:
    pts = [(k, r) for k, r in zip(n, rounds) if k in keep and r]
    return float(np.polyfit(np.log([k for k, _ in pts]), np.log([r for _, r in pts]), 1)[0])


def _li_toy_bound() -> tuple[float]:
    """Li et al. Theorem 5 (App. C.1): ||w~* - w*|| >= (E - 1) eta / 16 ||A_1 A_2 w*||, per unit of (E - 1) eta, on
    the smoke scale's construction."""
    from fedharness.config.load import load_config
    from fedharness.problems.li_toy import li_toy_matrices

    d = load_config(["experiment=li_toy"])["dataset"]
    A, b = li_toy_matrices(d["num_clients"], d["block"])
    w_star = np.linalg.solve(A.sum(0) + d["num_clients"] * d["mu"] * np.eye(A.shape[1]), b.sum(0))
    return (float(np.linalg.norm(A[0] @ A[1] @ w_star) / 16),)


SPEED = "\"linear speedup\": slope -1; -0.5 would be a square-root speedup"
FIG4 = "Fig. 4 \"fluctuates\": a rise one sees on a plot spanning the initial loss"
THRESHOLDS: list[Threshold] = [
    # ---------------------------------------------------------------- claims.py, judged over every draw
    Threshold("li_schemes", "claims.li_schemes", "scheme II rise after round 10 / initial, Synthetic(0,0)", FIG4,
              (C.RISE_OF_INITIAL,), False, lambda r: [r["synthetic(0,0)"]["fedavg_scheme_ii"]["rise_after"]]),
    Threshold("li_schemes", "claims.li_schemes", "scheme II rise after round 10 / initial, Synthetic(1,1)", FIG4,
              (C.RISE_OF_INITIAL,), False, lambda r: [r["synthetic(1,1)"]["fedavg_scheme_ii"]["rise_after"]]),
    Threshold("li_schemes_mnist", "claims.li_schemes_mnist", "unbalanced: scheme II rise after round 10 / initial",
              "Fig. 1d \"suffers from some instability\"", (C.RISE_OF_INITIAL,), False,
              lambda r: [r["unbalanced"]["fedavg_scheme_ii"]["rise_after"]]),
    Threshold("li_schemes_mnist", "claims.li_schemes_mnist", "balanced: \\|scheme I / scheme II - 1\\|",
              "Fig. 1c \"nearly the same performance\"", (C.NEARLY_THE_SAME,), False,
              lambda r: [abs(r["balanced"]["fedavg"]["final_loss"] / r["balanced"]["fedavg_scheme_ii"]["final_loss"]
                             - 1)]),
    Threshold("li_clients", "claims.li_clients", "relative spread of the final losses across K",
              "Fig. 1b / Fig. 3 \"overlap a lot\"", (C.NEARLY_THE_SAME,), False, lambda r: [r["relative_spread"]]),
    Threshold("li_toy", "claims.li_toy", "E = 1: \\|\\|w - w*\\|\\|", "Thm. 4 \"E = 1 ... converges to the optimum\""
              " (float64 round-off ~1e-14)", (1e-8,), False, lambda r: [r["constant"][0]]),
    Threshold("li_toy", "claims.li_toy", "floor / ((E - 1) eta): max / min over E = 2, 5, 10",
              "Thm. 4 \"Omega((E - 1) eta)\": proportional", (1.5,), False,
              lambda r: [max(r["constant_over_E_minus_1_eta"]) / min(r["constant_over_E_minus_1_eta"])]),
    Threshold("li_toy", "claims.li_toy", "decaying / constant step, E = 2, 5, 10", "Thm. 4: the decay goes on",
              (0.5,), False, lambda r: _ratios(list(zip(r["decaying"][1:], r["constant"][1:])))),
    Threshold("yang_speedup", "claims.yang_speedup", "slope of rounds to target in n", "Cor. 2 " + SPEED,
              C.SPEEDUP_SLOPE, False, lambda r: [r["FedAvg"]["slope"]]),
    Threshold("yang_table2", "claims.yang_table2", "SCAFFOLD / FedAvg rounds, every row",
              "Table 2's MNIST rows: 7/17 .. 17/7", C.ABOUT_THE_SAME_ROUNDS, True, _table2_round_ratios),
    Threshold("qu_speedup", "claims.qu_speedup", "strongly convex FedAvg slope in K", SPEED, C.SPEEDUP_SLOPE, False,
              lambda r: [r["strongly_convex"]["FedAvg"]["slope"]]),
    Threshold("qu_speedup", "claims.qu_speedup", "strongly convex Nesterov FedAvg slope in K", SPEED,
              C.SPEEDUP_SLOPE, False, lambda r: [r["strongly_convex"]["Nesterov FedAvg"]["slope"]]),
    Threshold("qu_speedup", "claims.qu_speedup", "overparameterized FedAvg slope, K b <= 4", SPEED,
              C.SPEEDUP_SLOPE, False, lambda r: [r["overparameterized"]["FedAvg"]["slope_below_critical"]]),
    Threshold("mangold", "claims.mangold", "RR / FedAvg averaged error, four cells",
              "Fig. 1 \"RR consistently outperforms FedAvg\"", (1.0,), False,
              lambda r: _mangold(r, "mangold_noisy", "rr_over_fedavg_average")
              + _mangold(r, "mangold_heterogeneous", "rr_over_fedavg_average")),
    Threshold("mangold", "claims.mangold", "SCAFFOLD / FedAvg, heterogeneous, H = 10 and 100",
              "Fig. 1 \"successfully suppresses\" (vs \"fails\")", (C.SCAFFOLD_SUPPRESSES,), False,
              lambda r: _mangold(r, "mangold_heterogeneous", "scaffold_over_fedavg_average")),
    Threshold("mangold", "claims.mangold", "SCAFFOLD / FedAvg, noisy, H = 10 and 100",
              "Fig. 1 \"Scaffold fails\" (vs \"suppresses\")", (C.SCAFFOLD_SUPPRESSES,), False,
              lambda r: _mangold(r, "mangold_noisy", "scaffold_over_fedavg_average")),
    Threshold("mangold_bias", "claims.mangold_bias", "FedAvg bias slope in gamma", "Prop. 5: first order",
              (1 - C.ORDER_HALF_WIDTH, 1 + C.ORDER_HALF_WIDTH), False, lambda r: [r["fedavg_slope_in_gamma"]]),
    Threshold("mangold_bias", "claims.mangold_bias", "FedAvg bias slope in H - 1", "Prop. 5: first order",
              (1 - C.ORDER_HALF_WIDTH, 1 + C.ORDER_HALF_WIDTH), False, lambda r: [r["fedavg_slope_in_H_minus_1"]]),
    Threshold("mangold_bias", "claims.mangold_bias", "RR bias slope in gamma", "Prop. 5 / Sec. 6: second order",
              (2 - C.ORDER_HALF_WIDTH, 2 + C.ORDER_HALF_WIDTH), False, lambda r: [r["rr_slope_in_gamma"]]),
    Threshold("wang_quadratic", "claims.wang_quadratic", "min(FedAvg, FedProx) / FedNova distance, fixed and random"
              " tau", "Fig. 2: FedNova \"reaches the optimum\", the others stall", (C.STALL_FACTOR,), False,
              lambda r: [min(r[w]["fedavg"], r[w]["fedprox"]) / r[w]["fednova"]
                         for w in ("per_client", "gaussian_steps")]),
    # ---------------------------------------------------------------- tests/test_reproductions.py, draw 0
    Threshold("li_toy", "test_li_toy_...", "floor / ((E - 1) eta), smallest", "our lower bound", (0.04,), False,
              lambda r: [min(r["constant_over_E_minus_1_eta"])]),
    Threshold("li_toy", "test_li_toy_...", "floor / ((E - 1) eta), smallest",
              "Thm. 5: (E - 1) eta / 16 \\|\\|A_1 A_2 w*\\|\\|", _li_toy_bound, True,
              lambda r: [min(r["constant_over_E_minus_1_eta"])]),
    Threshold("li_toy", "test_li_toy_...", "floor / ((E - 1) eta): max / min", "as claims.li_toy", (1.5,), False,
              lambda r: [max(r["constant_over_E_minus_1_eta"]) / min(r["constant_over_E_minus_1_eta"])]),
    Threshold("li_toy", "test_li_toy_...", "decaying / constant step, E = 2, 5, 10", "Thm. 4: the decay goes on",
              (0.25,), False, lambda r: _ratios(list(zip(r["decaying"][1:], r["constant"][1:])))),
    Threshold("wang_quadratic", "test_wang_quadratic_...", "FedAvg / FedNova, fixed tau", "Fig. 2 (stall)",
              (10.0,), False, lambda r: [r["fedavg_over_fednova_fixed_tau"]]),
    Threshold("wang_quadratic", "test_wang_quadratic_...", "FedAvg / FedNova, random tau", "Fig. 2 (stall)",
              (3.0,), False, lambda r: [r["fedavg_over_fednova_random_tau"]]),
    Threshold("wang_quadratic", "test_wang_quadratic_...", "FedAvg's distance / Lemma 1's surrogate gap",
              "Lemma 1: FedAvg's limit is the surrogate's optimum (the gap is the paper's number)", (0.9, 1.1), True,
              lambda r: [r["per_client"]["fedavg"] / r["surrogate_gap"]]),
    Threshold("mangold", "test_mangold_rr_average_...", "RR / FedAvg averaged error, H = 100",
              "Fig. 1 \"RR consistently outperforms\"", (0.4,), False,
              lambda r: [r[d]["H=100"]["rr_over_fedavg_average"] for d in ("mangold_noisy", "mangold_heterogeneous")]),
    Threshold("li_schemes", "test_li_scheme_ii_...", "scheme I rise after round 10 / initial, Synthetic(1,1)",
              "Fig. 4 \"performs stably\"", (C.RISE_OF_INITIAL,), False,
              lambda r: [r["synthetic(1,1)"]["fedavg"]["rise_after"]]),
    Threshold("qu_speedup", "test_qu_fedavg_...", "strongly convex FedAvg slope over K = 1, 4, 16", SPEED,
              C.SPEEDUP_SLOPE, False, lambda r: [_slope(r["strongly_convex"]["FedAvg"]["n"],
                                                        r["strongly_convex"]["FedAvg"]["rounds_to_target"],
                                                        {1, 4, 16})]),
    Threshold("yang_speedup", "test_yang_theory_...", "F - F* at the horizon, max / min",
              "Cor. 2: the same error in 1/n the rounds", (2.0,), False,
              lambda r: [max(r["FedAvg"]["final"]) / min(r["FedAvg"]["final"])]),
    Threshold("yang_speedup", "test_yang_theory_...", "slope of rounds to target in n", SPEED, (-0.5,), False,
              lambda r: [r["FedAvg"]["slope"]]),
    Threshold("yang_noniid", "test_yang_noniid_... (slow)", "partial participation, p = 1: share of rounds up",
              "Fig. 1b \"zigzagging\"", (0.2,), False,
              lambda r: [r[f"{m}/yang_s2"]["p=1"]["up_fraction"] for m in ("logreg", "2nn")]),
    Threshold("mangold", "test_mangold_full (slow)", "SCAFFOLD / FedAvg, heterogeneous, H = 100",
              "Fig. 1 \"successfully suppresses\"", (0.05,), False,
              lambda r: [r["mangold_heterogeneous"]["H=100"]["scaffold_over_fedavg_average"]]),
    Threshold("mangold_bias", "test_mangold_bias_... (slow)", "FedAvg bias / first-order term - 1, gamma = 0.005",
              "Prop. 5 gives the first-order term", (0.02,), True,
              lambda r: [r["gamma"]["0.005"]["fedavg"]["rel_err_vs_first_order"]]),
    Threshold("wang_quadratic", "test_wang_quadratic_and_synthetic_full (slow)", "FedProx / FedAvg distance, fixed"
              " tau", "Fig. 2: FedProx stalls as FedAvg", (0.5,), False,
              lambda r: [r["per_client"]["fedprox"] / r["per_client"]["fedavg"]]),
    Threshold("wang_synthetic", "test_wang_quadratic_and_synthetic_full (slow)", "FedNova / FedAvg final loss,"
              " three settings", "Fig. 5: FedNova lowest", (0.8,), False,
              lambda r: [c["fednova"]["final_loss"] / c["fedavg"]["final_loss"] for c in r.values()
                         if isinstance(c, dict) and "fednova" in c]),
]


def margin(threshold: tuple[float, ...], value: float) -> float:
    """|threshold - value| / |value| to the nearest bound (infinite for a value of 0)."""
    gap = min(abs(t - value) for t in threshold)
    return float("inf") if value == 0 else gap / abs(value)


def audit(results: dict) -> list[dict]:
    """Every threshold's values over the draws, the value nearest it in each draw, and the margins: at the median
    draw (claims) or draw 0 (tests), and at the closest draw."""
    rows = []
    for t in THRESHOLDS:
        if not (results.get(t.claim) or {}).get("over_draws"):  # a results.json without that claim yet
            continue
        draws = results[t.claim]["over_draws"]["results"]
        if not t.where.startswith("claims."):
            draws = draws[:1]  # the tests run draw 0
        bounds = t.bounds()
        nearest = [min(t.values(res), key=lambda v: margin(bounds, v)) for res in draws]
        read_at = float(np.median(nearest))
        m = margin(bounds, read_at)
        rows.append({"threshold": t, "bounds": bounds, "nearest": nearest, "value": read_at, "margin": m,
                     "closest": min(margin(bounds, v) for v in nearest),
                     "breaks_rule": m < RULE and not t.paper_gives})
    return rows


def _g(v: float) -> str:
    return "inf" if v == float("inf") else f"{v:.3g}"


def _percent(m: float) -> str:
    return "> 1000%" if m > 10 else f"{m:.0%}"


def docs_table(rows: list[dict]) -> str:
    lines = ["| claim | asserted in | compared | source | threshold | paper gives it | value nearest the threshold "
             "(median draw or draw 0) [per draw] | margin | closest draw's margin |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["threshold"]
        per_draw = ", ".join(_g(v) for v in r["nearest"])
        mark = " (within 20%)" if r["breaks_rule"] else ""
        bounds = " .. ".join(_g(x) for x in r["bounds"])
        lines.append(f"| `{t.claim}` | {t.where} | {t.compared} | {t.source} | {bounds} | "
                     f"{'yes' if t.paper_gives else 'no'} | {_g(r['value'])} [{per_draw}] | {_percent(r['margin'])}{mark} | "
                     f"{_percent(r['closest'])} |")
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
    broken = [r for r in rows if r["breaks_rule"]]
    print(f"{len(rows)} thresholds, {len(broken)} within {RULE:.0%} of their value without the paper giving them")
    for r in broken:
        print(f"  {r['threshold'].where}: {r['threshold'].compared}: margin {r['margin']:.0%}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
