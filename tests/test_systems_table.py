"""The systems table (conf/table/systems.yaml, docs/systems.md) on a tiny sweep: its numbers against the Parquet
rows read independently (first round meeting the target, sim_s there, clients per round, seconds per round, final
accuracy), censored seeds counted and left out of the means, the rows' order and names, and the files it writes
(its table.md that of today's harness/studies/systems.py, tests/table_md/systems.md)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
from closeness import mean_rounding
from study_sweeps import TARGET, at, column_texts, parquet_replicas, table_of, tiny_sweep, written

from fedharness.studies.table_spec import read_spec, summary
from fedharness.studies.table_text import markdown

SPEC = read_spec("systems")

K, ROUNDS, REPLICAS = 4, 6, 2
DEADLINE = 0.5  # a median client: 5 steps of 0.05 s and 2 x 2,600 bytes at 0.02 MB/s (0.26 s): 0.51 s


def sweep(tmp_path) -> str:
    return tiny_sweep(tmp_path, [{"algorithm": ["fedavg"], "cadence.deadline_s": [None, DEADLINE]},
                                 {"algorithm": ["fedavg"], "cadence.over_selection": [1.5]},
                                 {"algorithm": ["fednova"], "cadence.deadline_s": [DEADLINE],
                                  "cadence.late_work": ["partial"]}],
                      ok=4, num_clients=12, sampler="yang_s2", clients_per_round=K, rounds=ROUNDS, replicas=REPLICAS,
                      **{"network.compute_s_per_step": 0.05, "network.bandwidth_MB_per_s": 0.02,
                         "speed": "lognormal"})


def independent(res: str) -> pd.DataFrame:
    """Per (row, replica), from the Parquet files alone."""
    out = []
    for run, rep, r, first, last in parquet_replicas(res):
        cfg = json.loads(run.config_json)
        row = (cfg["algorithm"]["aggregator"], cfg["cadence"]["over_selection"], cfg["cadence"]["deadline_s"],
               cfg["cadence"]["late_work"])
        out.append({"row": row, "replica": rep, "reached": first is not None, "round": at(first, "round"),
                    "sim_s": at(first, "sim_s"), "participants": r.loc[r["round"] > 0, "participants"].mean(),
                    "max_participants": r["participants"].max(),
                    "s_per_round": last["sim_s"] / last["round"], "round_s": np.diff(r["sim_s"].to_numpy()),
                    "acc": last["test_acc"], "last_round": last["round"]})
    return pd.DataFrame(out)


def test_the_table_matches_the_parquet_rows(tmp_path):
    res = sweep(tmp_path)
    mine = independent(res)
    assert len(mine) == 4 * REPLICAS and (mine["last_round"] == ROUNDS).all()  # exact: round numbers
    table = table_of("systems", res)
    names = column_texts("systems", "row", table)
    assert names == ["FedAvg", f"FedAvg, deadline {DEADLINE:g} s (drop)", "FedAvg, over-selection 1.5",
                     f"FedNova, deadline {DEADLINE:g} s (partial)"]
    keys = [("fedavg", 1.0, None, "drop"), ("fedavg", 1.0, DEADLINE, "drop"), ("fedavg", 1.5, None, "drop"),
            ("fednova", 1.0, DEADLINE, "partial")]
    for key, row in zip(keys, table.itertuples()):
        m = mine[mine["row"] == key]
        hit = m[m["reached"]]
        assert row.seeds == REPLICAS == len(m) and row.reached == len(hit) and row.last_round == ROUNDS
        if len(hit):
            # two computations of a mean of seconds (the table's, pandas' here): within twice mean_rounding
            assert abs(row.sim_s_mean - hit["sim_s"].mean()) <= 2 * mean_rounding(hit["sim_s"])
            assert row.rounds_mean == hit["round"].mean()  # exact: integer rounds, summed exactly, divided once
            if len(hit) > 1:
                assert np.isclose(row.sim_s_std, hit["sim_s"].std()) and np.isclose(row.rounds_std,
                                                                                    hit["round"].std())
        else:
            assert np.isnan(row.sim_s_mean) and np.isnan(row.rounds_mean)
        assert np.isclose(row.participants, m["participants"].mean())
        assert np.isclose(row.s_per_round, m["s_per_round"].mean())
        assert np.isclose(row.acc_mean, 100 * m["acc"].mean()) and np.isclose(row.acc_std, 100 * m["acc"].std())
        assert (m["max_participants"] <= K).all()  # over-selection keeps K of its ceil(1.5 K)
        if key[2] is not None:  # a deadline: every round lasts at most D (an empty one exactly D)
            assert all((r <= DEADLINE + 1e-12).all() for r in m["round_s"])
    by = dict(zip(names, table.itertuples()))
    assert by["FedAvg"].participants == K and by["FedAvg, over-selection 1.5"].participants == K
    assert by[f"FedAvg, deadline {DEADLINE:g} s (drop)"].participants < K  # the deadline cuts someone
    # partial work keeps the clients the deadline would drop (those whose transfer fits, with one step)
    assert by[f"FedNova, deadline {DEADLINE:g} s (partial)"].participants > \
        by[f"FedAvg, deadline {DEADLINE:g} s (drop)"].participants
    # over-selection waits for the K-th fastest of 1.5 K, so its rounds are shorter than waiting for all K
    assert by["FedAvg, over-selection 1.5"].s_per_round < by["FedAvg"].s_per_round
    assert table["reached"].sum() > 0  # the target is met somewhere: the comparison above is not vacuous

    text = written("systems", res, tmp_path, "accuracy_vs_time.png")
    assert f"**digits, model auto**: target test_acc>={TARGET:g}, {REPLICAS} seeds, {ROUNDS} rounds, K = {K}" in text
    for name, row in zip(names, table.itertuples()):
        cells = (f"{row.sim_s_mean:.1f}" if row.reached else f"not reached (> {ROUNDS})")
        assert f"| {name} | {row.reached}/{REPLICAS} | {cells}" in text
        assert f"| {row.participants:.2f} | {row.s_per_round:.2f} | {row.acc_mean:.1f}" in text


def test_censored_seeds_are_counted_and_shown(tmp_path):
    seeds = pd.DataFrame({"problem": "digits", "model": "2nn", "target": "test_acc>=0.9", "algorithm": "FedAvg",
                          "deadline_s": 2.0, "late_work": "drop", "over_selection": 1.0, "speed": "slow_tail",
                          "speed_label": "slow_tail (10% of clients 10x slower per step)", "availability": "always",
                          "K": 10, "step_s": 0.05, "bandwidth": 1.0, "run_id": "r", "status": "ok",
                          "replica": [0, 1, 2], "reached": [True, False, False], "round": [4.0, np.nan, np.nan],
                          "sim_s": [6.5, np.nan, np.nan], "last_round": 10, "last_sim_s": [15.0, 18.0, 21.0],
                          "sim_s_per_round": [1.5, 1.8, 2.1], "participants": [9.0, 8.0, 7.0],
                          "test_acc": [0.9, 0.5, 0.6], "problem_label": "digits, 2NN"})
    row = summary(SPEC, seeds).iloc[0]
    assert (row["seeds"], row["reached"], row["rounds_mean"], row["sim_s_mean"]) == (3, 1, 4.0, 6.5)
    text = markdown(SPEC, summary(SPEC, seeds))
    assert text.startswith("**digits, 2NN**: target test_acc>=0.9, 3 seeds, 10 rounds, K = 10; median client: "
                           "0.05 s a step, 1 MB/s; availability always")
    assert ("| slow_tail (10% of clients 10x slower per step) | FedAvg, deadline 2 s (drop) | 1/3 | 6.5 | 4.0 | "
            "8.00 | 1.80 | 66.7 ± 20.8 |") in text
    none = markdown(SPEC, summary(SPEC, seeds.assign(reached=False, round=np.nan, sim_s=np.nan)))
    assert "| 0/3 | not reached (> 10) | not reached (> 10) | 8.00 |" in none
