"""What makes `make reproduce` cheaper must leave every number as it is (harness/studies/reproduce.py): grid points
that differ only in batchable keys train as one batched run, Mangold et al.'s FedAvg is read from the
Richardson-Romberg run's first chains, and a claim that reads final values alone evaluates its later draws only
at the ends."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedharness.studies import reproduce as R


def _quiet(_: str) -> None:
    pass


def test_points_that_differ_in_batchable_keys_run_as_one_batch_with_each_points_solo_numbers():
    logged: list[str] = []
    small = ["rounds=40", "eval_every=10"]
    g = R.run_grid("repro_li_toy", reference=True, log=logged.append, extra=small,
                   only={"algorithm.lr_schedule": ["constant"], "algorithm.local_steps": [2, 5]})
    assert len(g.points) == 2 and all("(one batch of 2)" in line for line in logged)
    for i, point in enumerate(g.points):
        overrides = ["experiment=li_toy", *small, *(f"{k}={v}" for k, v in point.items())]
        outcome, *_, last = R.run_overrides(overrides, reference=True)
        solo = R.curve(pd.DataFrame(outcome.rows), "dist_to_opt")
        batched = R.curve(g.select(algorithm__local_steps=int(point["algorithm.local_steps"])), "dist_to_opt")
        assert list(batched.index) == list(solo.index)
        np.testing.assert_allclose(batched.values, solo.values, rtol=1e-12)  # float64: equal up to round-off
        np.testing.assert_allclose(g.finals[i]["iterate"], last["iterate"], rtol=1e-12)


def test_fedavg_is_the_richardson_romberg_runs_first_chain():
    # mangold and mangold_bias read FedAvg's numbers from the RR run (step gamma, FedAvg's seeds and streams)
    g = R.run_grid("repro_mangold_bias", reference=True, log=_quiet, extra=["rounds=50", "eval_every=50"],
                   only={"algorithm.client_lr": [0.04]})
    fedavg, rr = g.finals[g.index(algorithm="fedavg")], g.finals[g.index(algorithm="fedavg_rr")]
    replicas = len(fedavg["iterate"])
    assert len(rr["iterate"]) == 2 * replicas  # the chains at gamma, then those at 2 gamma
    np.testing.assert_allclose(rr["iterate"][:replicas], fedavg["iterate"], rtol=1e-12)
    assert not np.allclose(rr["iterate"][replicas:], fedavg["iterate"], rtol=1e-3)  # 2 gamma: another chain


def test_a_draw_evaluated_only_at_the_ends_ends_where_every_round_evaluated_ends():
    assert R.final_only("li_clients", 0) == []  # draw 0 draws the figure: every round
    assert R.final_only("li_clients", 3) == ["eval_every=100"]  # li_clients' smoke scale: 100 rounds
    small = ["rounds=6"]
    every = R.run_grid("repro_li_clients", log=_quiet, draw=1, extra=small, only={"algorithm.clients_per_round": [10]})
    ends = R.run_grid("repro_li_clients", log=_quiet, draw=1, extra=[*small, "eval_every=6"],
                      only={"algorithm.clients_per_round": [10]})
    assert sorted(set(ends.frame["round"])) == [0, 6] and sorted(set(every.frame["round"])) == list(range(7))
    last = every.frame[every.frame["round"] == 6].sort_values("replica")
    for column in ("train_loss", "grad_norm_sq"):
        assert list(ends.frame[ends.frame["round"] == 6].sort_values("replica")[column]) == pytest.approx(
            list(last[column]), rel=1e-12)
