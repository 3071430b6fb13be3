"""Plugins on every worker (docs/extending.md, "Plugins"): a model, a data set and an aggregator registered from
the driver's Python, defined in a module the Ray workers cannot import, run in Ray shards, sweep tasks and
tuning workers; an installed package's `fedharness.registry.plugins` entry point needs no import by the user.

One local Ray (127.0.0.1) serves the module. Each distributed run is compared with the same run inline.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
import pytest
import ray
from hydra.core.config_store import ConfigStore

import fedharness
from fedharness.algorithms.registry import PARTS
from fedharness.problems import DATASETS, MODELS
from fedharness.registry.groups import METRICS
from fedharness.keys import number
from fedharness.studies.sweep import run_sweep, spec_from_dict
from ray_support import override_values, read_rounds

ROOT = Path(__file__).resolve().parent.parent

# The user's code: a module written to a temporary folder that only the driver has on sys.path.
USER_CODE = '''
import math

import numpy as np
import torch
from torch import nn

from fedharness.algorithms.solvers import LocalSGD
from fedharness.contracts import Aggregator, Coefficients
from fedharness.registry.groups import part


class TanhNet(nn.Module):
    def __init__(self, in_shape, num_classes, hidden=6):
        super().__init__()
        self.fc1 = nn.Linear(math.prod(in_shape), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def blobs(seed, n=300, dim=5, classes=3):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    x = rng.normal(0.0, 1.0, (classes, dim))[y] + rng.normal(0.0, 1.0, (n, dim))
    return (x[:240], y[:240]), (x[240:], y[240:])


@part("aggregator", "plug_uniform")  # registered when the driver imports this module, as a built-in part is
class SizeBlind(Aggregator):
    """Delta = (1/K) sum_k Delta_k, whatever the clients' sizes."""

    def coefficients(self, q, stats, tau):
        nan = np.full(len(q), np.nan)
        return Coefficients(np.full(q.shape, 1.0 / q.shape[1]), tau_eff=nan, chi2=nan, slowdown=nan)


def param_norm(w, split):
    """A metric: each replica's parameter norm."""
    return w.norm(dim=1)


class DampedSGD(LocalSGD):
    """Local SGD with step lr * damp (algorithm.damp, a key of its own)."""

    def __init__(self, damp: float = 1.0):
        super().__init__()
        self.damp = float(damp)

    def update(self, w, g, lr, state):
        return w.addcmul_(g, lr, value=-self.damp)
'''
RUN = ["model=plug_net", "dataset=plug_blobs", "algorithm.aggregator=plug_uniform", "algorithm.solver=plug_sgd",
       "+algorithm.damp=0.5", "partition=dirichlet", "algorithm.clients_per_round=3", "algorithm.local_steps=3",
       "algorithm.client_lr=0.4", "dtype=float64", "replicas=2", "heterogeneity=false", "rounds=4", "eval_every=2",
       "progress=false", "metrics=[plug_norm]"]
COMPARED = ["train_loss", "test_loss", "test_acc", "grad_norm_sq", "plug_norm"]




@pytest.fixture(scope="module")
def user_parts(tmp_path_factory, local_ray):
    """The user's module (imported after Ray started, from a folder only the driver has): its model, data set,
    solver (with a key of its own) and metric registered from Python, its aggregator by `registry.groups.part` as it
    is imported; the registries restored afterwards."""
    folder = tmp_path_factory.mktemp("user_code")
    name = f"plugin_user_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(USER_CODE)
    saved = [(reg, dict(reg)) for reg in (MODELS, DATASETS, METRICS, *PARTS.values())]
    sys.path.insert(0, str(folder))
    module = importlib.import_module(name)
    fedharness.register_model("plug_net", module.TanhNet, hidden=6)
    fedharness.register_dataset("plug_blobs", module.blobs, num_clients=6, n=300, dim=5)
    fedharness.register_part("solver", "plug_sgd", module.DampedSGD, keys={"damp": number("step factor", lo=0)})
    fedharness.register_metric("plug_norm", module.param_norm)
    yield name
    sys.path.remove(str(folder))
    del sys.modules[name]
    for reg, old in saved:
        reg.clear()
        reg.update(old)
    repo = ConfigStore.instance().repo
    for group, option in (("model", "plug_net"), ("dataset", "plug_blobs")):
        repo.get(group, {}).pop(f"{option}.yaml", None)


@ray.remote(num_cpus=1)
def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(["series", "round", "replica"]).reset_index(drop=True)


def _assert_same_rounds(got: pd.DataFrame, want: pd.DataFrame) -> None:
    got, want = _sorted(got), _sorted(want)
    assert got[["series", "round", "replica"]].values.tolist() == want[["series", "round", "replica"]].values.tolist()
    for col in COMPARED:
        np.testing.assert_allclose(got[col].to_numpy(float), want[col].to_numpy(float), rtol=1e-8, err_msg=col)


def _inline(tmp_path: Path, *extra: str) -> pd.DataFrame:
    r = fedharness.run([*RUN, *extra, f"results_dir={tmp_path / 'inline'}"])
    assert r.status == "ok"
    rounds = r.rounds
    assert rounds["chi2"].isna().all()  # the user's aggregator ran, not FedAvg's (which reports chi2)
    assert (rounds["plug_norm"] > 0).all()  # the user's metric too
    first, last = (rounds[rounds["round"] == k]["train_loss"].mean() for k in (0, 4))
    assert last < 0.9 * first  # it trained: equal trajectories mean something
    return rounds


def test_the_user_module_is_not_on_the_workers_path(user_parts):
    assert not ray.get(_importable.remote(user_parts))  # so the shipped parts reach workers by value
    assert importlib.util.find_spec(user_parts) is not None


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 14 s idle
def test_python_registrations_run_in_two_ray_shards_as_inline(user_parts, tmp_path):
    want = _inline(tmp_path)
    # the user's solver ran with its own key: lr 0.4 damped by 0.5 is plain SGD with lr 0.2
    plain = [o for o in RUN if o.split("=")[0] not in ("algorithm.solver", "+algorithm.damp", "algorithm.client_lr")]
    sgd = fedharness.run([*plain, "algorithm.client_lr=0.2", f"results_dir={tmp_path / 'sgd'}"]).rounds
    np.testing.assert_allclose(_sorted(sgd)["train_loss"], _sorted(want)["train_loss"], rtol=1e-9)
    got = fedharness.run([*RUN, "executor=ray", "ray.num_shards=2", f"results_dir={tmp_path / 'ray'}"])
    assert got.status == "ok" and got.runs.loc[0, ["model", "dataset"]].tolist() == ["plug_net", "plug_blobs"]
    _assert_same_rounds(got.rounds, want)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 8 s idle
def test_python_registrations_run_in_sweep_tasks_as_inline(user_parts, tmp_path):
    base = {**override_values([o for o in RUN if not o.startswith("progress=")]), "metrics": ["plug_norm"]}
    spec = spec_from_dict({"results_dir": str(tmp_path / "sweep"), "runner": "ray", "base": base,
                           "grid": {"seed": [0, 1]}, "resources": {"num_cpus": 1}}, "plugins")
    result = run_sweep(spec, echo=lambda line: None)
    assert result.counts() == {"ok": 2}, [o.error for o in result.outcomes.values()]
    assert all(int(o.worker.rsplit(":", 1)[1]) != os.getpid() for o in result.outcomes.values())
    for job in result.jobs:
        got = pd.DataFrame(read_rounds(tmp_path / "sweep", job.run_id))
        _assert_same_rounds(got, _inline(tmp_path / job.point["seed"], f"seed={job.point['seed']}"))


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_python_registrations_run_in_parallel_tuning_workers_as_inline(user_parts, tmp_path):
    journal = tmp_path / "study.log"
    fedharness.tune(["tune=default", *[o for o in RUN if o.split("=")[0] not in ("rounds", "eval_every")],
                     "eval.grad_norm=true",  # trials skip grad_norm_sq by default; compared with the inline run's
                     "tune.space.local_steps=null", "tune.space.client_lr.low=0.4", "tune.space.client_lr.high=0.8",
                     "tune.sampler.name=random", "tune.n_trials=2", "tune.parallel=2", "tune.budget.kind=rounds",
                     "tune.budget.total=4", "tune.reports=2", "tune.plots=false", f"tune.storage=journal:{journal}",
                     f"results_dir={tmp_path / 'tune'}"])
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    complete = [t for t in optuna.load_study(study_name="default-fedavg", storage=storage).trials
                if t.state.name == "COMPLETE"]
    assert len(complete) == 2 and all(t.user_attrs["status"] == "ok" for t in complete)
    assert all(int(t.user_attrs["worker"].rsplit(":", 1)[1]) != os.getpid() for t in complete)
    for t in complete:
        got = _sorted(pd.DataFrame(read_rounds(tmp_path / "tune", t.user_attrs["run_id"])))
        want = _inline(tmp_path / str(t.number), f"algorithm.client_lr={t.params['client_lr']!r}")
        _assert_same_rounds(got, want)
        assert t.value == pytest.approx(want[want["round"] == 4]["train_loss"].mean(), rel=1e-8)


# ---------------------------------------------------------------- an installed package's entry point

PLUGIN_PACKAGE = {
    "epplugin/__init__.py": '''
        import numpy as np

        import fedharness


        def gaussian_pairs(seed, n=200, dim=4):
            rng = np.random.default_rng(seed)
            y = rng.integers(0, 2, n)
            x = (2.0 * y[:, None] - 1.0) + rng.normal(0.0, 1.0, (n, dim))
            return (x[:160], y[:160]), (x[160:], y[160:])


        def register():
            fedharness.register_dataset("ep_pairs", gaussian_pairs, num_clients=4)
        ''',
    "epplugin/parts.py": '''
        import numpy as np

        import fedharness
        from fedharness.contracts import Aggregator, Coefficients


        @fedharness.register_part("aggregator", "ep_first")
        class FirstClient(Aggregator):
            """Delta = the first sampled client's Delta."""

            def coefficients(self, q, stats, tau):
                coef = np.zeros(q.shape)
                coef[:, 0] = 1.0
                nan = np.full(len(q), np.nan)
                return Coefficients(coef, tau_eff=nan, chi2=nan, slowdown=nan)
        ''',
    "epplugin-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: epplugin\nVersion: 0.1\n",
    "epplugin-0.1.dist-info/entry_points.txt":
        "[fedharness.registry.plugins]\ndata = epplugin:register\nparts = epplugin.parts\n",
}

# Run in a fresh interpreter: the package is installed (on its path) and never imported by this script.
USER_SCRIPT = '''
import sys

import numpy as np

import fedharness

overrides = ["dataset=ep_pairs", "model=logreg", "algorithm.aggregator=ep_first", "algorithm.sampler=full",
             "algorithm.local_steps=1", "algorithm.client_lr=0.5", "dtype=float64", "rounds=1", "eval_every=1",
             "heterogeneity=false", "progress=false", "results_dir=out"]
assert "epplugin" not in sys.modules
r = fedharness.run(overrides)
print("loaded", sorted(m for m in sys.modules if m.startswith("epplugin")))
print("status", r.status, r.runs.loc[0, "dataset"])
for name, result in (("first", r), ("fedavg", fedharness.run([*overrides, "algorithm.aggregator=fedavg"]))):
    rounds = result.rounds.sort_values("round")
    print(name, repr(float(rounds["train_loss"].iloc[0])), repr(float(rounds["train_loss"].iloc[-1])))
'''


def _write_package(site: Path) -> None:
    for rel, text in PLUGIN_PACKAGE.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(textwrap.dedent(text))


def _python(cwd: Path, site: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 14 s idle
def test_an_installed_packages_entry_point_registers_its_parts_with_no_import(tmp_path):
    site = tmp_path / "site"
    _write_package(site)
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    done = _python(tmp_path, site, "user.py")
    assert done.returncode == 0, done.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert out["loaded"] == "['epplugin', 'epplugin.parts']"  # loaded by fedharness, lazily, when the run began
    assert out["status"] == "ok ep_pairs"
    first, fedavg = ([float(v) for v in out[k].split()] for k in ("first", "fedavg"))
    assert first[0] == fedavg[0]  # the same data and start; then one client's step differs from the average
    assert abs(first[1] - fedavg[1]) > 1e-3 * abs(fedavg[0] - fedavg[1])
    listed = _python(tmp_path, site, "-m", "fedharness.cli", "list")
    assert listed.returncode == 0, listed.stderr[-3000:]
    assert "ep_pairs" in listed.stdout and "ep_first" in listed.stdout
    # an entry point that does not load stops every command with one line naming it
    (site / "epplugin-0.1.dist-info/entry_points.txt").write_text("[fedharness.registry.plugins]\ndata = epplugin:regster\n")
    broken = _python(tmp_path, site, "-m", "fedharness.cli", "list")
    assert broken.returncode == 2 and broken.stderr.strip().splitlines() == [
        "fedharness: error: invalid value for 'entry point fedharness.registry.plugins': 'data = epplugin:regster' (loading it "
        "failed (AttributeError: module 'epplugin' has no attribute 'regster'))"]
