"""The compression table (conf/table/compression.yaml, docs/compression.md) on a tiny sweep: its numbers against
the Parquet rows read independently (first round meeting the target, MB by then, final accuracy, bytes a client
sends a round), censored seeds counted and left out of the means, and the files it writes (its table.md that of
today's harness/studies/compression.py, tests/table_md/compression.md)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from closeness import mean_rounding
from study_sweeps import TARGET, at, mb_at, parquet_replicas, table_of, tiny_sweep, written

from fedharness.studies.table_spec import read_spec, summary
from fedharness.studies.table_text import markdown

SPEC = read_spec("compression")

K, ROUNDS, REPLICAS, DIM = 5, 6, 2, 65 * 10  # digits with logistic regression: 64 features + bias, 10 classes


def sweep(tmp_path) -> str:
    return tiny_sweep(tmp_path, [{"compress": ["none"]},
                                 {"compress": ["topk"], "compress.ratio": [0.1], "compress.error_feedback": [True]}],
                      ok=2, num_clients=10, sampler="scheme_ii", clients_per_round=K, rounds=ROUNDS,
                      replicas=REPLICAS)


def independent(res: str) -> pd.DataFrame:
    """Per (compressor, replica), from the Parquet files alone."""
    out = []
    for run, rep, r, first, last in parquet_replicas(res):
        name = (json.loads(run.config_json).get("compress") or {}).get("name", "none")
        out.append({"compressor": name, "replica": rep, "reached": first is not None, "round": at(first, "round"),
                    "mb": mb_at(first), "acc": last["test_acc"], "last_round": last["round"],
                    "up": last["bytes_up"] / (last["round"] * K)})  # scheme_ii: K distinct clients a round
    return pd.DataFrame(out)


def test_the_table_matches_the_parquet_rows(tmp_path):
    res = sweep(tmp_path)
    mine = independent(res)
    assert len(mine) == 2 * REPLICAS and (mine["last_round"] == ROUNDS).all()
    table = table_of("compression", res)
    assert list(table["compressor"]) == ["none", "topk"] and list(table["ef"]) == [False, True]
    for row in table.itertuples():
        m = mine[mine["compressor"] == row.compressor]
        hit = m[m["reached"]]
        assert row.seeds == REPLICAS and row.reached == len(hit) and row.last_round == ROUNDS
        if len(hit):
            assert row.rounds_mean == hit["round"].mean()  # exact: integer rounds, summed exactly, divided once
            # two computations of a mean of megabytes (the table's, pandas' here): within twice mean_rounding
            assert abs(row.mb_mean - hit["mb"].mean()) <= 2 * mean_rounding(hit["mb"])
            if len(hit) > 1:
                assert np.isclose(row.rounds_std, hit["round"].std()) and np.isclose(row.mb_std, hit["mb"].std())
        else:
            assert np.isnan(row.rounds_mean) and np.isnan(row.mb_mean)
        assert np.isclose(row.acc_mean, 100 * m["acc"].mean()) and np.isclose(row.acc_std, 100 * m["acc"].std())
        assert (m["up"] == row.up_bytes).all()  # the same bytes in every seed and round
    up = dict(zip(table["compressor"], table["up_bytes"]))
    assert up == {"none": DIM * 4, "topk": 65 * (4 + 4)}  # dense float32; k = 0.1 d int32 indices and values
    assert table["reached"].sum() > 0  # the target is met somewhere: the comparison above is not vacuous

    text = written("compression", res, tmp_path, "accuracy_vs_mb.png")
    assert f"target test_acc>={TARGET:g}, {REPLICAS} seeds, {ROUNDS} rounds" in text
    for row in table.itertuples():
        cell = (f"{row.rounds_mean:.1f}" if row.reached else f"not reached (> {ROUNDS})")
        assert cell in text and f"{row.reached}/{REPLICAS}" in text and f"{row.acc_mean:.1f}" in text


def test_censored_seeds_are_counted_and_shown(tmp_path):
    seeds = pd.DataFrame({"problem": "digits", "target": "test_acc>=0.9", "compressor": "sign", "param": np.nan,
                          "ef": False, "run_id": "r", "status": "ok", "replica": [0, 1, 2],
                          "reached": [True, False, False],
                          "round": [4.0, np.nan, np.nan], "mb": [1.5, np.nan, np.nan], "last_round": 10,
                          "test_acc": [0.9, 0.5, 0.6], "up_per_client": 90.0, "dense_bytes": 2600,
                          "problem_label": "digits, 2NN", "param_label": "–"})
    row = summary(SPEC, seeds).iloc[0]
    assert (row["seeds"], row["reached"], row["rounds_mean"], row["mb_mean"]) == (3, 1, 4.0, 1.5)
    text = markdown(SPEC, summary(SPEC, seeds))
    assert "| sign | – | no | 1/3 | 4.0 | 1.50 | 90 (3.46%) | 66.7 ± 20.8 |" in text
    none = markdown(SPEC, summary(SPEC, seeds.assign(reached=False, round=np.nan, mb=np.nan)))
    assert "| 0/3 | not reached (> 10) | not reached (> 10) |" in none
