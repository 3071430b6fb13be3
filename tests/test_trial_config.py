"""A tuning trial's config on the fast path (harness/config/compose.py compose_values: the study's base composed
once, numeric values read without Hydra's parser; harness/studies/tuning/budget.py: a replay per cost setting) is
exactly what composing the trial's overrides from scratch through Hydra gives, types included, and its rounds are
what the run then records."""

from __future__ import annotations

import math
import random

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from fedharness.assembly.build import algorithm_for
from fedharness.config import compose as compose_module
from fedharness.config.load import load_config
from fedharness.config.overrides import format_value
from fedharness.runs.execute import execute
from fedharness.settings import RunSettings
from fedharness.settings import RunSettings
from fedharness.studies.tuning import budget as budget_module
from fedharness.studies.tuning.budget import Budget
from fedharness.studies.tuning.spec import build_spec, trial_config

W1 = ["dataset.samples_per_client=200", "dataset.num_clients=100", "algorithm.clients_per_round=10"]


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (1 == 1.0 == True, but a trial's E must stay an int)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def hydra_reads(text: str):
    """(key, value) as Hydra's own parser reads the override, or the exception type it raises."""
    try:
        ov = OverridesParser.create().parse_overrides([text])[0]
    except HydraException as err:
        return type(err)
    return ov.key_or_group, ov.value()


def fast_reads(text: str):
    try:
        return compose_module._parsed_value(text)
    except compose_module._NotValues:
        return compose_module._NotValues
    except HydraException as err:
        return type(err)


def test_numbers_are_read_as_hydra_reads_them():
    """The numeric fast path against Hydra's parser: a trial's floats and ints as format_value writes them, and
    texts next to them that Hydra reads otherwise (they take Hydra's path)."""
    draw = random.Random(0)
    floats = [10 ** draw.uniform(-12, 12) * draw.choice((1, -1)) for _ in range(300)]
    floats += [0.0, -0.0, 1.0, 1e-05, 1.5e+20, 123456789.0, 5e-324, 1.7976931348623157e308]
    ints = [0, 1, -1, 7, 50, 10 ** 20, -(10 ** 12)]
    texts = [f"algorithm.client_lr={format_value(v)}" for v in floats + ints]
    texts += [f"seed={v}" for v in ("1e5", "01", "1_000", ".5", "1.", "-.5", "1E-05", "+3", "inf", "nan", "true",
                                    "abc", "1.5e+20x", "0x10", "1.5.2")]
    for text in texts:
        fast, hydra = fast_reads(text), hydra_reads(text)
        assert same(fast, hydra), (text, fast, hydra)
    assert compose_module._NUMBER_OVERRIDE.fullmatch("algorithm.client_lr=0.001")  # floats do take the fast path
    for refused in ("dataset=3", "hydra.job.chdir=1", "+seed=3", "~seed", "seed=1,2"):
        assert fast_reads(refused) is compose_module._NotValues, refused


STUDY = ["tune=default", "tune.sampler.name=random", "tune.n_trials=8", "tune.plots=false"]
VALUES = [{"client_lr": 0.0123, "local_steps": 7}, {"client_lr": 1e-05, "local_steps": 1},
          {"client_lr": 0.7071067811865476, "local_steps": 50}, {"client_lr": 1.0, "local_steps": 3}]


@pytest.mark.parametrize("run", [
    W1,  # the benchmark's: a plain base, the values go into a copy of its dict
    ["experiment=mangold_noisy"],  # rounds = ${div:10000,${algorithm.local_steps}}: the OmegaConf path
])
def test_a_trials_config_equals_its_overrides_composed_from_scratch(run, tmp_path):
    """trial_config's config against load_config of the overrides it records (what `fedharness run` rebuilds it
    from), composed through Hydra with nothing cached: ==, and the same types (client_lr=1.0 a float, E an int)."""
    spec = build_spec([*STUDY, "tune.budget.kind=rounds", "tune.budget.total=12", "tune.reports=4",
                       f"results_dir={tmp_path}", *run], probe=False)
    for values in VALUES:
        cfg, overrides = trial_config(spec, values)
        compose_module._composed_unresolved.cache_clear()
        compose_module._plain.cache_clear()
        compose_module._hydra_value.cache_clear()
        scratch = {**load_config(overrides), "progress": False}  # a key a trial sets besides its overrides
        # and the other: trials skip the gradient norm (eval.grad_norm, left out of the overrides: a re-run records it)
        assert cfg["eval"]["grad_norm"] is False and scratch["eval"]["grad_norm"] is True
        scratch["eval"] = {**scratch["eval"], "grad_norm": False}
        assert same(cfg, scratch), values
        assert type(cfg["algorithm"]["client_lr"]) is float and type(cfg["algorithm"]["local_steps"]) is int
    if run[0] == "experiment=mangold_noisy":  # the interpolation followed the trial's E, in the fresh composition
        assert load_config(run, values=["algorithm.local_steps=7"])["rounds"] == 10000 // 7


def _costs(rows: list[dict], kind: str) -> dict[int, int]:
    """The run's recorded cost after each evaluated round (largest over replicas), from its rows."""
    out: dict[int, int] = {}
    for r in rows:
        if r.get("series", "iterate") == "iterate":
            cost = r["bytes_up"] + r["bytes_down"] if kind == "bytes" else r[kind]
            out[r["round"]] = max(out.get(r["round"], 0), int(cost))
    return out


@pytest.mark.parametrize("kind,total", [("local_steps", 60), ("grad_evals", 6000), ("bytes", 9_000)])
def test_rounds_for_is_the_last_round_the_run_records_within_the_budget(kind, total, tmp_path):
    """For several E: a run one round longer than rounds_for records a cost <= total after rounds_for rounds and
    over it after one more (scheme_i draws with replacement, so a round's cost varies and only the replay knows)."""
    budget = Budget(kind, total)
    for steps in (1, 3, 7):
        cfg = load_config(["dataset=quadratic", "algorithm.sampler=scheme_i", "algorithm.clients_per_round=5",
                           f"algorithm.local_steps={steps}", "eval_every=1", "replicas=2", "progress=false",
                           f"results_dir={tmp_path}"])
        rounds = budget.rounds_for(cfg)
        cfg["rounds"] = rounds + 1
        costs = _costs(execute(RunSettings.from_config(cfg)).rows, kind)
        assert costs[rounds] <= total < costs[rounds + 1], (kind, steps, rounds, costs[rounds], costs[rounds + 1])


def test_studies_that_differ_only_where_a_replay_does_not_read_share_it(replays, tmp_path):
    """Another results_dir, eval or metrics: the same replay; another seed or number of replicas: a new one."""
    real = budget_module._cumulative_cost
    base = ["dataset=quadratic", "algorithm=fednova", "algorithm.sampler=scheme_i", "algorithm.clients_per_round=5"]
    budget = Budget("grad_evals", 3000)
    rounds = budget.rounds_for(load_config([*base, f"results_dir={tmp_path / 'a'}"]))
    for other in (f"results_dir={tmp_path / 'b'}", "eval.per_client=true", "eval_every=3", "progress=false"):
        assert budget.rounds_for(load_config([*base, other])) == rounds
    assert len(replays) == 1
    for other in ("seed=1", "replicas=3"):
        cfg, before = load_config([*base, other]), len(replays)
        assert budget.rounds_for(cfg) == int(real(cfg, "grad_evals", 3000).searchsorted(3000, side="right"))
        assert len(replays) == before + 2  # its own replay, not the cached one (and the comparison's)


class Replays(list):
    """The E of each replay budget.py runs (`real`: the replay itself)."""

    real = staticmethod(budget_module._replay)


@pytest.fixture
def replays(monkeypatch) -> Replays:
    """Empty budget caches, and every replay recorded by its E."""
    monkeypatch.setattr(budget_module, "_ROUNDS", {})
    monkeypatch.setattr(budget_module, "_UNIT", {})
    seen = Replays()
    monkeypatch.setattr(budget_module, "_replay", lambda cfg, *a: seen.append(cfg["algorithm"]["local_steps"])
                        or Replays.real(cfg, *a))
    return seen


@pytest.mark.parametrize("run", [
    ["algorithm.sampler=scheme_i"],  # with replacement: a client drawn twice trains once
    ["algorithm.sampler=scheme_ii", "algorithm.dropout=0.5", "replicas=3"],  # rounds where no client returns
    ["algorithm=fedavg_rr", "algorithm.rr=H", "replicas=2"],  # Richardson-Romberg over H: tau_factor 2
])
def test_costs_that_scale_with_e_give_the_rounds_of_es_own_replay(run, replays):
    """E's rounds from the replay at E = 1 (x E; bytes as they are) against E's own full replay, for each kind."""
    real = replays.real
    for kind, total in (("local_steps", 90), ("grad_evals", 9000), ("bytes", 12_000)):
        for steps in (2, 3, 7, 11):
            cfg = load_config(["dataset=quadratic", "algorithm.clients_per_round=4", *run,
                               f"algorithm.local_steps={steps}"])
            problem = budget_module.problem_for(cfg)
            algorithm = algorithm_for(RunSettings.from_config(cfg), problem)
            layout, _ = budget_module.build_series(cfg["replicas"], **cfg["algorithm"])
            own = real(cfg, problem, algorithm, layout, kind, total)
            assert Budget(kind, total).rounds_for(cfg) == int(own.searchsorted(total, side="right")), (kind, steps)
    assert replays == [1, 1, 1]  # one replay per kind, at E = 1


@pytest.mark.parametrize("run", [["algorithm=fednova"], ["algorithm.local_work=random_steps"],
                                 ["algorithm.local_work_min=true"]])
def test_costs_that_may_not_scale_are_replayed_at_e(run, replays):
    """FedNova's coefficients and random or FedAvg-min local work depend on tau: each E is replayed itself."""
    for steps in (2, 3):
        Budget("local_steps", 60).rounds_for(load_config(["dataset=quadratic", *run, f"algorithm.local_steps={steps}"]))
    assert replays == [2, 3]
