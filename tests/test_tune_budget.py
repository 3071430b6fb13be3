"""A budget held fixed across trials: rounds follow from it, and every trial spends it (read back from Parquet)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fedharness import cli
from fedharness.config.load import load_config
from fedharness.runs.execute import execute as execute_settings
from fedharness.settings import RunSettings
from fedharness.studies.tuning.budget import Budget

QUAD = ["dataset=quadratic", "algorithm.sampler=full", "dtype=float64"]


def execute(cfg: dict):
    """The runner on a plain config that a test changes (its rounds), as the tuner changes a trial's."""
    return execute_settings(RunSettings.from_config(cfg))


def _final_rows(results) -> pd.DataFrame:
    rounds = pd.read_parquet(results / "rounds")
    runs = pd.read_parquet(results / "runs")
    it = rounds[rounds.series == "iterate"]
    last = it.loc[it.groupby("run_id", observed=True)["round"].idxmax()]
    last = last.assign(run_id=last.run_id.astype(str))
    runs = runs.assign(run_id=runs.run_id.astype(str))
    return last.merge(runs[["run_id", "trial", "status", "rounds_done", "config_json"]], on="run_id")


def test_local_steps_budget_gives_e10_a_tenth_of_the_rounds_and_every_trial_spends_it(tmp_path):
    code = cli.main(["tune", "tune=default", *QUAD, f"results_dir={tmp_path}", "tune.plots=false",
                     "tune.sampler.name=grid", "tune.n_trials=4", "tune.space.client_lr=null",
                     "tune.space.local_steps={key: algorithm.local_steps, type: categorical, choices: [1, 2, 5, 10]}",
                     "tune.budget.kind=local_steps", "tune.budget.total=200", "tune.objective.metric=subopt"])
    assert code == 0
    final = _final_rows(tmp_path)
    assert len(final) == 4 and final.status.eq("ok").all()
    e = final.config_json.map(lambda c: json.loads(c)["algorithm"]["local_steps"])
    rounds = dict(zip(e, final["round"]))
    assert rounds == {1: 200, 2: 100, 5: 40, 10: 20}
    assert rounds[10] * 10 == rounds[1]
    assert final.local_steps.eq(200).all()  # the engine's own counter, read back from rounds/
    trials = pd.read_parquet(tmp_path / "trials")
    assert sorted(trials.budget_used) == [200] * 4 and trials.budget_total.eq(200).all()


def test_budget_not_divisible_spends_at_most_the_budget_and_less_than_one_round_short(tmp_path):
    code = cli.main(["tune", "tune=default", *QUAD, f"results_dir={tmp_path}", "tune.plots=false",
                     "tune.sampler.name=random", "tune.n_trials=4", "tune.space.client_lr=null",
                     "tune.space.local_steps.low=3", "tune.space.local_steps.high=9",
                     "tune.budget.total=100", "tune.objective.metric=subopt"])
    assert code == 0
    final = _final_rows(tmp_path)
    e = final.config_json.map(lambda c: json.loads(c)["algorithm"]["local_steps"])
    assert (final["round"] == 100 // e).all()
    assert ((final.local_steps <= 100) & (final.local_steps > 100 - e)).all()


@pytest.mark.parametrize("kind,column", [("grad_evals", "grad_evals"), ("bytes", None)])
def test_other_budgets_match_the_engine_counters(tmp_path, kind, column):
    """scheme_i samples with replacement: a client drawn twice is counted once, so the
    per-round cost varies and only the replayed plans can give the exact rounds."""
    cfg = load_config(["dataset=quadratic", "algorithm.sampler=scheme_i", "algorithm.clients_per_round=5",
                       "algorithm.local_steps=3", f"results_dir={tmp_path}", "progress=false"])
    budget = Budget(kind, 1000 if kind == "grad_evals" else 20_000)
    cfg["rounds"] = budget.rounds_for(cfg)
    rows = execute(cfg).rows
    used = budget.used(rows)
    last = max(r["round"] for r in rows)
    assert last == cfg["rounds"] and used <= budget.total
    cfg["rounds"] += 1  # one more round would overspend
    assert Budget(kind, budget.total).used(execute(cfg).rows) > budget.total


@pytest.mark.parametrize("kind", ["local_steps", "bytes"])
def test_a_budget_with_slow_and_absent_clients_follows_the_clock(tmp_path, kind):
    """With a deadline, partial work, availability and top-k, who takes part and their steps follow each replica's
    clock: the replayed plans (on the clock, with the encoded upload's size) give the run's exact rounds."""
    cfg = load_config(["dataset=quadratic", "dataset.num_clients=20", "algorithm.sampler=yang_s2",
                       "algorithm.clients_per_round=5", "algorithm.local_steps=6", "algorithm.aggregator=fednova",
                       "network.compute_s_per_step=1.0", "speed=lognormal", "cadence.deadline_s=5.0",
                       "cadence.late_work=partial", "availability=duty_cycle", "availability.period_s=40",
                       "compress=topk", "compress.ratio=0.2", f"results_dir={tmp_path}", "progress=false"])
    budget = Budget(kind, 400 if kind == "local_steps" else 20_000)
    cfg["rounds"] = budget.rounds_for(cfg)
    rows = execute(cfg).rows
    assert max(r["round"] for r in rows) == cfg["rounds"] and budget.used(rows) <= budget.total
    assert any(r["local_steps"] % 6 for r in rows)  # partial work: not E steps a round
    cfg["rounds"] += 1  # one more round would overspend
    assert Budget(kind, budget.total).used(execute(cfg).rows) > budget.total


def test_rounds_budget_is_the_rounds():
    cfg = load_config(QUAD)
    assert Budget("rounds", 37).rounds_for(cfg) == 37


# A study composes its base config once and applies each trial's values to a copy (harness/config/compose.py
# compose_values), as Hydra applies value overrides; interpolations such as li_toy's rounds = steps // E and
# mangold_noisy's ${div:...} still follow each trial's E.
TRIAL_BASES = [["experiment=li_toy"], ["experiment=mangold_noisy"], QUAD]
TRIAL_VALUES = [["algorithm.local_steps=7", "algorithm.client_lr=0.0123"], ["algorithm.local_steps=3", "seed=5"],
                ["algorithm.client_lr=1e-05", "algorithm.local_steps=20"]]


@pytest.mark.parametrize("base", TRIAL_BASES)
def test_trial_values_on_the_composed_base_equal_a_full_composition(base):
    for values in TRIAL_VALUES:
        assert load_config(base, values=values) == load_config([*base, *values])
    assert load_config(["experiment=li_toy"], values=["algorithm.local_steps=7"])["rounds"] == 3000 // 7


def test_a_study_composes_its_base_once_and_overrides_naming_a_group_compose_in_full(monkeypatch):
    import fedharness.config.compose as compose_module
    from fedharness.config.compose import compose_values

    calls = []
    real = compose_module.compose
    monkeypatch.setattr(compose_module, "compose", lambda **kw: calls.append(kw["overrides"]) or real(**kw))
    compose_module._composed_unresolved.cache_clear()
    base = ["experiment=li_toy", "seed=11"]
    for e in (1, 2, 3, 5):
        assert compose_values(base, [f"algorithm.local_steps={e}"])["rounds"] == 3000 // e
    assert calls == [base]
    assert compose_values(base, ["dataset=quadratic"]) == compose_values([*base, "dataset=quadratic"], [])
    assert calls[1] == [*base, "dataset=quadratic"]  # a group: Hydra composes it whole


@pytest.mark.parametrize("algorithm", ["fedavg", "fednova", "scaffold", "fedadam"])
@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 7 s idle for fedavg, 4 s each other
def test_a_rounds_price_is_replayed_once_per_cost_setting_and_equals_the_replay(algorithm, monkeypatch):
    """Learning rates, mu and momentum never change a round's plan nor its counters: configs that differ only in them
    share one replay (issue 26), and every cached answer is what replaying that very config gives."""
    import numpy as np

    from fedharness.studies.tuning import budget as budget_module

    replays = []
    real = budget_module._cumulative_cost
    monkeypatch.setattr(budget_module, "_cumulative_cost", lambda cfg, kind, total: replays.append(1)
                        or real(cfg, kind, total))
    monkeypatch.setattr(budget_module, "_ROUNDS", {})
    base = ["dataset=quadratic", f"algorithm={algorithm}", "algorithm.clients_per_round=4",
            "algorithm.local_work=random_steps", "algorithm.steps_high=6"]  # random tau_k: rounds vary with E
    for kind in ("local_steps", "grad_evals", "bytes"):
        budget = Budget(kind, 600 if kind != "bytes" else 20_000)
        for steps_low in (1, 3):
            for lr in (0.001, 0.03, 0.9):
                cfg = load_config([*base, f"algorithm.steps_low={steps_low}", f"algorithm.client_lr={lr}",
                                   f"algorithm.server_lr={lr * 2}", f"algorithm.mu={lr}", f"algorithm.momentum={lr}"])
                replayed = int(np.searchsorted(real(cfg, kind, budget.total), budget.total, side="right"))
                assert budget.rounds_for(cfg) == replayed, (kind, steps_low, lr)
    assert len(replays) == 3 * 2  # one per (kind, steps_low), not per learning rate


def test_a_budget_other_than_rounds_refuses_an_asynchronous_run_in_one_line():
    from fedharness.errors import ConfigError

    cfg = load_config(["dataset=quadratic", "algorithm.sampler=yang_s2", "algorithm.clients_per_round=4",
                       "cadence=fedbuff", "cadence.concurrency=8", "cadence.buffer=4"])
    with pytest.raises(ConfigError) as err:
        Budget("local_steps", 400).rounds_for(cfg)
    assert err.value.key == "cadence" and err.value.value == "fedbuff" and "in rounds" in err.value.allowed
    assert Budget("rounds", 40).rounds_for(cfg) == 40  # server steps
