"""Issue 35's threshold audit (harness/studies/threshold_audit.py): every threshold of claims.py lies strictly
between what its claim predicts and what the alternative it rules out predicts, each criterion turns at its
threshold, and docs/reproductions.md's tables are the ones the committed results give under today's criteria."""

from __future__ import annotations

import copy
import json

import pytest

from fedharness.studies import claims as C
from fedharness.studies import threshold_audit as T


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(T.RESULTS.read_text())


def test_every_threshold_separates_its_claim_from_the_alternative_it_rules_out():
    bad = [name for name, b in C.BOUNDARIES.items() if not T.separates(b)]
    assert bad == []
    assert len(C.BOUNDARIES) >= 16
    # every threshold of claims.py is audited, and each audited row names one
    assert {t.boundary for t in T.THRESHOLDS} == set(C.BOUNDARIES)


def test_a_threshold_at_or_beyond_the_alternative_is_flagged():
    # issue 30's speedup band ended at -0.5, the square-root speedup it should rule out: not strictly between
    at_alternative = C.Boundary(-0.5, -1.0, "a square-root speedup", -0.5, "linear speedup")
    # "fails" read as "SCAFFOLD worse than FedAvg by 10%": beyond the claim's own prediction (1)
    beyond = C.Boundary(1.1, 1.0, "\"suppresses\"", 0.0, "\"fails\"")
    assert not T.separates(at_alternative) and not T.separates(beyond)
    assert T.separates(C.Boundary(-0.75, -1.0, "a square-root speedup", -0.5, "linear speedup"))


def test_the_speedup_criterion_turns_at_its_thresholds():
    # the midpoints: -0.75 between linear (-1) and square root (-0.5), -1.5 between linear and quadratic (-2)
    assert C.SPEEDUP_SLOWEST.value == -0.75 and C.SPEEDUP_FASTEST.value == -1.5
    for slope, linear in ((-1.0, True), (-0.76, True), (-0.74, False), (-0.5, False), (-1.49, True), (-1.51, False),
                          (-2.0, False), (None, False)):
        assert C.linear_speedup(slope) is linear, slope


def test_each_criterion_holds_at_its_claims_prediction_and_fails_at_the_alternatives(results):
    # a committed draw with the compared numbers set to each prediction: the criterion's part follows
    def mangold(heterogeneous: float, noisy: float) -> dict:
        res = copy.deepcopy(results["mangold"]["over_draws"]["results"][0])
        for H in ("H=10", "H=100"):
            res["mangold_heterogeneous"][H]["scaffold_over_fedavg_average"] = heterogeneous
            res["mangold_noisy"][H]["scaffold_over_fedavg_average"] = noisy
        return C.mangold(res)

    claim = mangold(C.SCAFFOLD_SUPPRESSES.claim, C.SCAFFOLD_FAILS.claim)
    swapped = mangold(C.SCAFFOLD_SUPPRESSES.alternative, C.SCAFFOLD_FAILS.alternative)
    assert claim["SCAFFOLD removes heterogeneity"] and claim["SCAFFOLD fails on noise"]
    assert not swapped["SCAFFOLD removes heterogeneity"] and not swapped["SCAFFOLD fails on noise"]

    def toy(ratio: float) -> dict:  # per-unit floors whose max / min is `ratio`
        res = copy.deepcopy(results["li_toy"]["over_draws"]["results"][0])
        res["constant_over_E_minus_1_eta"] = [0.06, 0.06, 0.06 * ratio]
        return C.li_toy(res)

    assert toy(C.FLOOR_PROPORTIONAL.claim)["floor linear in (E - 1) eta"]
    assert not toy(C.FLOOR_PROPORTIONAL.alternative)["floor linear in (E - 1) eta"]

    def bias(slope: float) -> dict:
        res = dict(results["mangold_bias"]["over_draws"]["results"][0], fedavg_slope_in_gamma=slope)
        return C.mangold_bias(res)

    assert bias(1.0)["FedAvg first order in gamma"]
    assert not bias(0.0)["FedAvg first order in gamma"] and not bias(2.0)["FedAvg first order in gamma"]


def test_the_docs_threshold_table_is_the_committed_results_audit(results):
    docs = T.DOCS.read_text()
    table = docs.split(T.TABLE_BEGIN, 1)[1].split(T.TABLE_END, 1)[0].strip()
    assert table == T.docs_table(T.audit(results))


def test_the_docs_verdicts_are_todays_criteria_on_the_committed_draws(results):
    # the summary table (k of n, the parts, the verdict) re-computed from every committed draw with claims.py as it
    # is now: a criterion changed without regenerating results.json and the docs fails here
    from fedharness.studies.draws_report import TABLE_BEGIN, TABLE_END, docs_table, summarise

    fresh = {name: {"over_draws": {**summarise(name, res["over_draws"]["results"], res["over_draws"]["seeds"]),
                                   "results": res["over_draws"]["results"]}}
             for name, res in results.items() if isinstance(res, dict) and res.get("over_draws")}
    for name, res in fresh.items():
        for key in ("k", "n", "holds", "parts"):
            assert res["over_draws"][key] == results[name]["over_draws"][key], (name, key)
    docs = T.DOCS.read_text()
    assert docs.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip() == docs_table(fresh)


def test_docs_table_keeps_each_claims_order_after_results_json_sorts_its_keys(results):
    # results.json is written with sorted keys; a run of some claims (--only) reads the others back from it, and
    # their row in docs/reproductions.md must still list the parts and numbers in the criterion's order
    from fedharness.studies.draws_report import docs_table, summarise

    draws = results["li_schemes"]["over_draws"]["results"]
    fresh = {"li_schemes": {"over_draws": {**summarise("li_schemes", draws, [0] * len(draws)), "results": draws}}}
    reread = json.loads(json.dumps(fresh, sort_keys=True))
    assert list(reread["li_schemes"]["over_draws"]["parts"]) != list(fresh["li_schemes"]["over_draws"]["parts"])
    assert docs_table(reread) == docs_table(fresh)
