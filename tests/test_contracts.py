"""harness/contracts.py: every built-in part, problem and model satisfies its Protocol; the engine never probes a
part for a member; every algorithm key is declared once, beside its part; a part added in one file with its keys
is built, validated and listed like a built-in one."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fedharness
from fedharness import contracts
from fedharness.config import schema
from fedharness.algorithms import aggregators, local_work, local_work_fixed, registry, robust, samplers, schedules, \
    server, solvers
from fedharness.cli import main
from fedharness.config.compose import defaults
from fedharness.config.load import load_config
from fedharness.registry.groups import PARTS, PROTOCOLS
from fedharness.algorithms import personal, personalized, series
from fedharness.errors import ConfigError
from fedharness.problems.data import DataProblem
from fedharness.problems.lazy import LazySyntheticProblem
from fedharness.problems.li_toy import LiToyProblem
from fedharness.problems.objectives import LinearRegression, SoftmaxRegression
from fedharness.problems.quadratic import QuadraticProblem

ROOT = Path(__file__).resolve().parent.parent
KEY_MODULES = (samplers, local_work, local_work_fixed, schedules, solvers, personal, personalized, aggregators, robust,
               server, series, registry)


def _quadratic() -> QuadraticProblem:
    rng = np.random.default_rng(0)
    A = np.stack([np.diag(rng.uniform(0.5, 2.0, 3)) for _ in range(4)])
    return QuadraticProblem(A, rng.normal(size=(4, 3)), dtype=torch.float64)


HEADED = ("fedrep", "fedbabu")


def _logreg() -> DataProblem:
    x, y = np.random.default_rng(1).normal(size=(40, 5)), np.arange(40) % 3
    return DataProblem(SoftmaxRegression((5,), 3, 0.01), x, y, np.split(np.arange(40), 4), None, None, 4)


def _algorithm_config(**changes) -> dict:
    return {**defaults("algorithm", "fedavg"), "client_steps": [2, 3, 4, 5], "tau_eff_value": 3.0, **changes}


@pytest.mark.parametrize("kind,name", [(kind, name) for kind, names in registry.BUILTIN_PARTS.items()
                                       for name in sorted(names)])
def test_every_builtin_part_satisfies_its_protocol(kind, name):
    problem = _quadratic() if name not in HEADED else _logreg()  # FedRep, FedBABU: a model with a head
    built = registry.build_part(kind, _algorithm_config(**{kind: name}), {"problem": problem, "num_clients": 4,
                                                                          "rounds": 10})
    assert isinstance(built, PROTOCOLS[kind])
    assert PROTOCOLS[kind] in type(built).__mro__  # it subclasses its Protocol, so it has the defaults


def test_wrappers_problems_models_and_series_satisfy_theirs():
    problem = _quadratic()
    algorithm = registry.build_algorithm(_algorithm_config(dropout=0.2, local_work_min=True), problem, rounds=10)
    assert isinstance(algorithm.sampler, samplers.Dropout) and isinstance(algorithm.sampler, contracts.Sampler)
    assert isinstance(algorithm.local_work, local_work.MinOfSelection)
    assert isinstance(algorithm.local_work, contracts.LocalWork)
    x, y = np.random.default_rng(1).normal(size=(40, 5)), np.arange(40) % 3
    data = DataProblem(SoftmaxRegression((5,), 3, 0.01), x, y, np.split(np.arange(40), 4), None, None, 4)
    lazy = LazySyntheticProblem(SoftmaxRegression((60,), 10, 0.0), 5, 1.0, 1.0, 0, 20, 4, torch.float32, "cpu",
                                1.0, 2)
    for p in (problem, LiToyProblem(3, 2), data, lazy):
        assert isinstance(p, contracts.Problem)
    assert (problem.memory_budget, lazy.exact_reference, data.hessians(), data.client_minima()) == (None, False,
                                                                                                     None, None)
    for model in (SoftmaxRegression((5,), 3, 0.0), LinearRegression((5,), 3, 0.0)):
        assert isinstance(model, contracts.Model) and model.kernel is None
    assert isinstance(series.PolyakAverage(0.5), contracts.SeriesHook)
    assert DataProblem(data.objective, x, y, np.split(np.arange(40), 4), None, None, 4, memory_budget=10**6) \
        .with_dtype(torch.float64).memory_budget == 10**6  # a constructor argument, kept by with_dtype


def test_optional_members_have_explicit_defaults():
    solver = solvers.LocalSGD()
    x = torch.zeros(2, 3, dtype=torch.float64)
    assert solver.comm_factor == 1 and solver.init_server_ctx(x) == {} and solver.update_server_ctx({}, {}) == {}
    assert solvers.ScaffoldSGD().comm_factor == 2 and set(solvers.ScaffoldSGD().init_server_ctx(x)) == {"control"}
    assert server.ServerSGD(1.0).init_state(x) == {} and set(server.ServerAdam(1.0, 0.9, 0.99, 1e-3).init_state(x)) \
        == set(contracts.AdamState.__annotations__)
    assert set(server.ServerMomentum(1.0, 0.9).init_state(x)) == set(contracts.MomentumState.__annotations__)
    assert set(series.PolyakAverage(0.5).init_state(x)) == set(contracts.AverageState.__annotations__)
    assert samplers.SchemeII(4, 2).with_replacement is False and samplers.SchemeI(4, 2).with_replacement is True


def test_core_and_algorithms_never_probe_a_part_for_a_member():
    files = sorted([*(ROOT / "harness" / "core").glob("*.py"), *(ROOT / "algorithms").glob("*.py")])
    assert len(files) > 10
    probes = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
              for i, line in enumerate(f.read_text().splitlines(), 1) if re.search(r"\b(hasattr|getattr)\(", line)]
    assert probes == []


def test_every_algorithm_key_is_declared_exactly_once_beside_its_part():
    declared: dict[str, str] = {}
    for module in KEY_MODULES:
        for key in module.KEYS:
            assert key not in declared, f"algorithm.{key} declared in {declared[key]} and {module.__name__}"
            declared[key] = module.__name__
    assert set(schema.group_keys("algorithm", "fedavg")) - {"name"} == set(declared)
    for kind, names in registry.BUILTIN_PARTS.items():
        for name in names:
            assert registry.undeclared(PARTS[kind][name]) == [], (kind, name)  # its parameters are keys or context


AGGREGATOR = '''
import numpy as np

import fedharness
from fedharness.contracts import Aggregator, Coefficients
from fedharness.keys import number


@fedharness.register_part("aggregator", "damped", keys={"damping": number("every coefficient times this", lo=0,
                                                                           hi=1, lo_open=True)})
class Damped(Aggregator):
    def __init__(self, damping: float = 0.5):
        self.damping = damping

    def coefficients(self, q, stats, tau):
        nan = np.full(len(q), np.nan)
        return Coefficients(self.damping * q, nan, nan, nan)
'''


@pytest.fixture
def damped(tmp_path, monkeypatch):
    """A new aggregator and its key, in one file of a package outside fedharness; the registry restored after."""
    (tmp_path / "damped_part.py").write_text(AGGREGATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = {kind: dict(reg) for kind, reg in PARTS.items()}
    import damped_part

    yield damped_part
    for kind, reg in PARTS.items():
        reg.clear()
        reg.update(saved[kind])
    del sys.modules["damped_part"]


def test_a_part_added_in_one_file_is_validated_built_and_listed(damped, tmp_path, capsys):
    base = ["dataset=quadratic", "algorithm.aggregator=damped", f"results_dir={tmp_path / 'res'}"]
    with pytest.raises(ConfigError) as err:
        load_config([*base, "+algorithm.damping=2"])
    assert err.value.key == "algorithm.damping" and "(0, 1]" in str(err.value)
    with pytest.raises(ConfigError, match="algorithm.dampng"):
        load_config([*base, "+algorithm.dampng=0.5"])
    cfg = load_config([*base, "+algorithm.damping=0.25"])
    problem = _quadratic()
    algorithm = registry.build_algorithm(cfg["algorithm"], problem, rounds=cfg["rounds"])
    assert isinstance(algorithm.aggregator, damped.Damped) and algorithm.aggregator.damping == 0.25
    r = fedharness.run([*base, "+algorithm.damping=0.25", "rounds=2", "progress=false"])
    assert r.status == "ok" and r.rounds["chi2"].isna().all()
    assert main(["config", "algorithm"]) == 0
    assert re.search(r"\+algorithm\.damping = 0\.5 +every coefficient times this", capsys.readouterr().out)


def test_a_part_with_an_undeclared_parameter_is_refused():
    class Sloppy(contracts.Aggregator):
        def __init__(self, strength: float = 1.0):
            self.strength = strength

    with pytest.raises(ConfigError, match="strength"):
        fedharness.register_part("aggregator", "sloppy", Sloppy)
    assert "sloppy" not in PARTS["aggregator"]
    with pytest.raises(ConfigError, match="built-in keys"):
        fedharness.register_part("aggregator", "sloppy", Sloppy, keys={"mu": schema.number("x"),
                                                                       "strength": schema.number("y")})


def test_executors_references_and_exact_solve_capabilities_satisfy_their_protocols():
    from fedharness.backends.ray_executor import RayExecutor
    from fedharness.core.executors import InlineExecutor, LoopExecutor
    from fedharness.references.solve import Reference, solve_reference

    members = ("local_updates", "checkpoint", "restore", "keep_replicas", "client_scores", "close")
    for cls in (InlineExecutor, LoopExecutor, RayExecutor):
        assert all(callable(getattr(cls, m, None)) for m in members), cls
    problem = _quadratic()
    assert isinstance(problem, contracts.ClosedForm) and isinstance(solve_reference(problem), contracts.Reference)
    x, y = np.random.default_rng(1).normal(size=(40, 5)), np.arange(40) % 3
    data = DataProblem(SoftmaxRegression((5,), 3, 0.01), x, y, np.split(np.arange(40), 4), None, None, 4)
    lazy = LazySyntheticProblem(SoftmaxRegression((60,), 10, 0.0), 5, 1.0, 1.0, 0, 20, 4, torch.float32, "cpu",
                                1.0, 2)
    assert isinstance(data, contracts.ExactSolve) and not isinstance(data, contracts.ClosedForm)
    assert not isinstance(lazy, contracts.ExactSolve)  # F over lazily generated clients is never built whole
    assert isinstance(Reference(np.zeros(2), 0.0, 0.0), contracts.Reference)


def test_contracts_hold_contracts_only():
    registries = [name for name, value in vars(contracts).items() if isinstance(value, dict) and name.isupper()]
    assert registries == []  # PARTS, METRICS, ...: fedharness.registry.groups


def test_data_sets_models_and_partitioners_are_built_by_signature_binding():
    from fedharness.registry.groups import DATASETS, MODELS

    assert set(DATASETS.declared("blobs")) == {"num_clients", "data_seed", "unseen_clients", "variant", "dim",
                                               "samples_per_client", "std", "shift"}
    model = MODELS.build("logreg", {"l2": 0.5}, {"in_shape": (4,), "num_classes": 3})
    assert isinstance(model, SoftmaxRegression) and model.l2 == 0.5
    with pytest.raises(ConfigError, match="dataset.nope"):
        DATASETS.build("blobs", {"num_clients": 2, "variant": "noisy", "dim": 2, "samples_per_client": 4,
                                 "shift": 0.0, "nope": 1}, {"seed": 0})
    with pytest.raises(ConfigError, match="dataset.variant"):
        DATASETS.build("blobs", {"dim": 2, "samples_per_client": 4, "shift": 0.0, "num_clients": 2}, {"seed": 0})
