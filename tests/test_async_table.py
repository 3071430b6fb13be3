"""The asynchronous table (conf/table/async.yaml, docs/async.md "The table") on a tiny sweep: its numbers
against the Parquet rows read independently (first evaluated server step meeting the target, sim_s and MB there,
updates per step, seconds per step, final accuracy, the speedup over synchronous FedAvg), censored seeds counted and
left out of the means, the rows' order and names, and the files it writes (its table.md that of today's
harness/studies/async_table.py, tests/table_md/async.md)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from closeness import mean_rounding
from study_sweeps import TARGET, at, column_texts, mb_at, parquet_replicas, table_of, tiny_sweep, written

from fedharness.studies.table_spec import read_spec, summary
from fedharness.studies.table_text import markdown

SPEC = read_spec("async")

K, ROUNDS, REPLICAS = 4, 6, 2
DEADLINE = 0.6  # a fast client: 5 steps of 0.05 s and 2 x 2,600 bytes at 0.02 MB/s (0.26 s): 0.51 s; a slow one 2.76 s
ASYNC_ROUNDS, ASYNC_EVERY = 24, 3


def sweep(tmp_path) -> str:
    return tiny_sweep(tmp_path, [{"cadence": ["sync"], "cadence.deadline_s": [None, DEADLINE]},
                                 {"cadence": ["fedbuff"], "cadence.concurrency": [6], "cadence.buffer": [2],
                                  "rounds": [2 * ROUNDS]},
                                 {"cadence": ["fedasync"], "cadence.concurrency": [4], "cadence.alpha": [0.5],
                                  "rounds": [ASYNC_ROUNDS], "eval_every": [ASYNC_EVERY]}],
                      ok=4, num_clients=12, sampler="yang_s2", clients_per_round=K, rounds=ROUNDS, replicas=REPLICAS,
                      **{"network.compute_s_per_step": 0.05, "network.bandwidth_MB_per_s": 0.02,
                         "speed": "slow_tail"})


def independent(res: str) -> pd.DataFrame:
    """Per (row, replica), from the Parquet files alone."""
    out = []
    for run, rep, r, first, last in parquet_replicas(res):
        s = json.loads(run.config_json)["cadence"]
        row = (s["name"], s.get("concurrency"), s.get("buffer"), s.get("alpha"), s.get("deadline_s"))
        out.append({"row": row, "replica": rep, "reached": first is not None, "step": at(first, "round"),
                    "sim_s": at(first, "sim_s"), "mb": mb_at(first),
                    "participants": r.loc[r["round"] > 0, "participants"].mean(),
                    "steps": r["round"].to_numpy(), "s_per_step": last["sim_s"] / last["round"],
                    "acc": last["test_acc"], "last_round": last["round"]})
    return pd.DataFrame(out)


def test_the_table_matches_the_parquet_rows(tmp_path):
    res = sweep(tmp_path)
    mine = independent(res)
    assert len(mine) == 4 * REPLICAS
    table = table_of("async", res)
    names = column_texts("async", "row", table)
    assert names == ["FedAvg (synchronous)", f"FedAvg, deadline {DEADLINE:g} s (drop)", "FedBuff C = 6, M = 2",
                     "FedAsync C = 4, alpha 0.5"]
    keys = [("sync", None, None, None, None), ("sync", None, None, None, DEADLINE), ("fedbuff", 6, 2, None, None),
            ("fedasync", 4, None, 0.5, None)]
    last = [ROUNDS, ROUNDS, 2 * ROUNDS, ASYNC_ROUNDS]
    updates = [None, None, 2, 1]  # FedBuff takes M a step (C >= M always in flight), FedAsync 1
    for key, rounds, m_per_step, row in zip(keys, last, updates, table.itertuples()):
        m = mine[mine["row"] == key]
        hit = m[m["reached"]]
        assert row.seeds == REPLICAS == len(m) and row.reached == len(hit) and row.last_round == rounds
        assert (m["last_round"] == rounds).all()
        if len(hit):
            # two computations of a mean of seconds (the table's, pandas' here): within twice mean_rounding
            assert abs(row.sim_s_mean - hit["sim_s"].mean()) <= 2 * mean_rounding(hit["sim_s"])
            assert row.steps_mean == hit["step"].mean()  # exact: integer steps, summed exactly, divided once
            assert np.isclose(row.mb_mean, hit["mb"].mean())
            if len(hit) > 1:
                assert np.isclose(row.sim_s_std, hit["sim_s"].std()) and np.isclose(row.steps_std,
                                                                                    hit["step"].std())
        else:
            assert np.isnan(row.sim_s_mean) and np.isnan(row.steps_mean)
        assert np.isclose(row.participants, m["participants"].mean())
        if m_per_step is not None:
            assert row.participants == m_per_step
        assert np.isclose(row.s_per_step, m["s_per_step"].mean())
        assert np.isclose(row.acc_mean, 100 * m["acc"].mean()) and np.isclose(row.acc_std, 100 * m["acc"].std())
    # FedAsync is evaluated every ASYNC_EVERY server steps: steps to the target are read there
    fedasync = mine[mine["row"] == keys[3]]
    assert all(list(s) == list(range(0, ASYNC_ROUNDS + 1, ASYNC_EVERY)) for s in fedasync["steps"])
    assert (fedasync["step"].dropna() % ASYNC_EVERY == 0).all()
    # the speedup over synchronous FedAvg: its mean seconds to the target over the row's
    sync = mine[(mine["row"] == keys[0]) & mine["reached"]]["sim_s"].mean()
    for key, row in zip(keys, table.itertuples()):
        hit = mine[(mine["row"] == key) & mine["reached"]]
        assert np.isclose(row.x_sync, sync / hit["sim_s"].mean(), equal_nan=True)
    assert table["x_sync"].iloc[0] == 1.0
    assert (table["reached"] > 0).all()  # every row meets the target somewhere: the checks above are not vacuous
    assert table["participants"].iloc[1] < K  # the deadline cuts a slow client off

    text = written("async", res, tmp_path, "accuracy_vs_time.png")
    assert f"**digits, model auto**: target test_acc>={TARGET:g}, {REPLICAS} seeds, K = {K} (synchronous)" in text
    for name, rounds, row in zip(names, last, table.itertuples()):
        cells = (f"{row.sim_s_mean:.1f}" if row.reached else f"not reached (> {rounds})")
        assert f"| {name} | {rounds} | {row.reached}/{REPLICAS} | {cells}" in text
        assert f"| {row.participants:.2f} | {row.s_per_step:.2f} | {row.acc_mean:.1f}" in text


def test_censored_seeds_are_counted_and_shown():
    seeds = pd.DataFrame({"problem": "digits", "model": "2nn", "target": "test_acc>=0.9", "mode": "fedbuff",
                          "C": 20, "M": 10, "alpha": np.nan, "staleness": "poly 0.5", "max_staleness": np.nan,
                          "algorithm": "FedAvg", "deadline_s": np.nan, "late_work": "–", "speed": "slow_tail",
                          "speed_label": "slow_tail (10% of clients 10x slower per step)", "availability": "always",
                          "K": 10, "step_s": 0.05, "bandwidth": 1.0, "run_id": "r", "status": "ok",
                          "replica": [0, 1, 2], "reached": [True, False, False], "round": [4.0, np.nan, np.nan],
                          "sim_s": [6.5, np.nan, np.nan], "mb": [3.0, np.nan, np.nan], "last_round": 10,
                          "last_sim_s": [15.0, 18.0, 21.0], "sim_s_per_round": [1.5, 1.8, 2.1], "participants": 10.0,
                          "test_acc": [0.9, 0.5, 0.6], "problem_label": "digits, 2NN"})
    row = summary(SPEC, seeds).iloc[0]
    assert (row["seeds"], row["reached"], row["steps_mean"], row["sim_s_mean"]) == (3, 1, 4.0, 6.5)
    assert np.isnan(row["x_sync"])  # no synchronous row to compare with
    text = markdown(SPEC, summary(SPEC, seeds))
    assert text.startswith("**digits, 2NN**: target test_acc>=0.9, 3 seeds, K = 10 (synchronous); median client: "
                           "0.05 s a step, 1 MB/s; availability always")
    assert ("| slow_tail (10% of clients 10x slower per step) | FedBuff C = 20, M = 10 | 10 | 1/3 | 6.5 | – | 4.0 | "
            "3.00 | 10.00 | 1.80 | 66.7 ± 20.8 |") in text
    none = markdown(SPEC, summary(SPEC, seeds.assign(reached=False, round=np.nan, sim_s=np.nan)))
    assert "| 0/3 | not reached (> 10) | – | not reached (> 10) | not reached (> 10) | 10.00 |" in none
