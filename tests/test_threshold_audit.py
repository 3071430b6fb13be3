"""Issue 30's threshold audit (harness/studies/threshold_audit.py): no threshold of claims.py or
tests/test_reproductions.py sits within 20% of the value it was observed at unless the paper gives it, and
docs/reproductions.md's table is the one the committed results give."""

from __future__ import annotations

import copy
import json

import pytest

from fedharness.studies import threshold_audit as T


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(T.RESULTS.read_text())


def test_margin_is_the_distance_to_the_nearest_bound_over_the_value():
    assert T.margin((0.5,), 0.4) == pytest.approx(0.25)
    assert T.margin((-1.5, -0.5), -0.6) == pytest.approx(0.1 / 0.6)  # the band's nearer bound
    assert T.margin((0.05,), 0.0) == float("inf")  # a value of 0 is no observation near the threshold


def test_no_threshold_sits_within_20_percent_of_its_value_unless_the_paper_gives_it(results):
    rows = T.audit(results)
    assert len(rows) == len(T.THRESHOLDS)
    broken = [(r["threshold"].where, r["threshold"].compared, round(r["margin"], 3)) for r in rows
              if r["breaks_rule"]]
    assert broken == []


def test_a_threshold_next_to_its_value_is_flagged(results):
    # SCAFFOLD / FedAvg on the noisy data at 0.55 in every draw: 10% above claims.SCAFFOLD_SUPPRESSES (0.5)
    moved = copy.deepcopy(results)
    for res in moved["mangold"]["over_draws"]["results"]:
        for H in ("H=10", "H=100"):
            res["mangold_noisy"][H]["scaffold_over_fedavg_average"] = 0.55
    flagged = [r for r in T.audit(moved) if r["breaks_rule"]]
    assert [(r["threshold"].where, r["value"]) for r in flagged] == [("claims.mangold", 0.55)]
    assert flagged[0]["margin"] == pytest.approx(0.05 / 0.55)


def test_the_docs_table_is_the_committed_results_audit(results):
    docs = T.DOCS.read_text()
    table = docs.split(T.TABLE_BEGIN, 1)[1].split(T.TABLE_END, 1)[0].strip()
    assert table == T.docs_table(T.audit(results))


def test_docs_table_keeps_each_claims_order_after_results_json_sorts_its_keys(results):
    # results.json is written with sorted keys; a run of some claims (--only) reads the others back from it, and
    # their row in docs/reproductions.md must still list the parts and numbers in the criterion's order
    from fedharness.studies.draws_report import docs_table, summarise

    draws = results["li_schemes"]["over_draws"]["results"]
    fresh = {"li_schemes": {"over_draws": {**summarise("li_schemes", draws, [0] * len(draws)), "results": draws}}}
    reread = json.loads(json.dumps(fresh, sort_keys=True))
    assert list(reread["li_schemes"]["over_draws"]["parts"]) != list(fresh["li_schemes"]["over_draws"]["parts"])
    assert docs_table(reread) == docs_table(fresh)
