"""The drift table's cells (harness/studies/drift.py): the floor is the median subopt over the last 10% of the
evaluated rounds, the rounds to the floor the first round within 10x of it, FedExP read on its last_two series."""

from __future__ import annotations

import numpy as np
import pandas as pd

from fedharness.studies import drift
from fedharness.studies.reports.data import Results


def _results(curves: dict[str, dict[str, np.ndarray]]) -> Results:
    runs, rounds = [], []
    for run_id, (name, series) in enumerate(curves.items()):
        runs.append({"run_id": str(run_id), "cfg": {"algorithm.name": name, "dataset.name": "quadratic",
                                                    "algorithm.local_steps": 5, "algorithm.sampler": "full"}})
        for label, sub in series.items():
            rounds += [{"run_id": str(run_id), "series": label, "replica": 0, "round": t, "subopt": v}
                       for t, v in enumerate(sub)]
    return Results(None, pd.DataFrame(runs), pd.DataFrame(rounds))


def test_floor_and_rounds_to_ten_times_above_it():
    decay = 1e-3 + 2.0 ** -np.arange(20.0)  # floor 1e-3 + 2^-19 ~ 1.0019e-3 over rounds 18 and 19
    jumpy = np.full(20, 5.0)  # fedexp's iterate is ignored: its last_two series is read
    seeds = drift.seed_rows(_results({"fedavg": {"iterate": decay}, "fedexp": {"iterate": jumpy, "last_two": decay},
                                      "mime": {"iterate": np.append(decay[:-1], np.inf)}}))
    floor = float(np.median(decay[-2:]))  # the last 10% of 20 rounds
    first = int(np.argmax(decay <= 10 * floor))  # 2^-t <= 9 floor + ... : t = 7 (2^-7 = 7.8e-3 < 1.0e-2)
    assert first == 7
    for name in ("fedavg", "fedexp"):
        row = seeds[seeds["algorithm"] == name].iloc[0]
        # exact: the median of two values is one correctly rounded (a + b) / 2 on either side; rounds an index
        assert row["floor"] == floor and row["rounds"] == first
    assert np.isnan(seeds[seeds["algorithm"] == "mime"].iloc[0]["floor"])  # a non-finite subopt: diverged
    assert "diverged" in drift.markdown(drift.summary(seeds))
