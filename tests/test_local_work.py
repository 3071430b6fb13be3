"""Local work: exact step counts, the distributions of random local work, FedAvg-min, and the engine's counters."""

from __future__ import annotations

import numpy as np
import pytest

from fedharness.algorithms import local_work
from fedharness.core.engine import Engine
from fedharness.errors import ConfigError
from fedharness.core.executors import InlineExecutor
from fedharness.runs.execute import prepare

SIZES = np.array([10, 24, 25, 100, 7, 48])
B = 24


def _clients(replicas: int, k: int = 4, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, len(SIZES), (replicas, k))


def test_fixed_steps_and_epochs_exact():
    clients = _clients(3)
    np.testing.assert_array_equal(local_work.FixedSteps(7).steps(0, np.arange(3), 2, clients, SIZES, B), 7)
    epochs = local_work.Epochs(3).steps(0, np.arange(3), 2, clients, SIZES, B)
    per_client = np.array([1, 1, 2, 5, 1, 2])  # ceil(n_k / 24)
    np.testing.assert_array_equal(epochs, 3 * per_client[clients])


def test_random_steps_uniform_on_the_range():
    clients = _clients(20_000)
    tau = local_work.RandomSteps(3, 7).steps(1, np.arange(20_000), 4, clients, SIZES, B)
    assert tau.min() == 3 and tau.max() == 7
    freq = np.bincount(tau.reshape(-1), minlength=8)[3:] / tau.size
    np.testing.assert_allclose(freq, 0.2, atol=0.01)


def test_random_epochs_exact_multiples_of_epoch_length():
    clients = _clients(5000)
    tau = local_work.RandomEpochs(2, 5).steps(1, np.arange(5000), 4, clients, SIZES, B)
    epoch = -(-SIZES[clients] // B)
    assert np.all(tau % epoch == 0)
    epochs = tau // epoch
    assert epochs.min() == 2 and epochs.max() == 5
    np.testing.assert_allclose(np.bincount(epochs.reshape(-1), minlength=6)[2:] / epochs.size, 0.25, atol=0.015)


def test_random_work_is_keyed_by_client_not_by_selection():
    """A client's tau depends on (seed, replica, round, client) only: not on its slot or on the others sampled."""
    work = local_work.RandomSteps(1, 50)
    a = work.steps(3, np.array([0, 1]), 5, np.array([[0, 1, 2], [0, 1, 2]]), SIZES, B)
    b = work.steps(3, np.array([0, 1]), 5, np.array([[2, 4, 0], [5, 1, 3]]), SIZES, B)
    assert a[0, 2] == b[0, 0] and a[0, 0] == b[0, 2] and a[1, 1] == b[1, 1]
    assert not np.array_equal(a[0], a[1])  # replicas have their own streams
    c = work.steps(3, np.array([0, 1]), 6, np.array([[0, 1, 2], [0, 1, 2]]), SIZES, B)
    assert not np.array_equal(a, c)  # and rounds


def test_clipped_gaussian_steps():
    clients = _clients(20_000)
    free = local_work.ClippedGaussianSteps(30.0, 4.0, 1, 100).steps(0, np.arange(20_000), 1, clients, SIZES, B)
    assert free.mean() == pytest.approx(30.0, abs=0.1)
    assert free.std() == pytest.approx(np.sqrt(16 + 1 / 12), abs=0.1)  # rounding adds 1/12
    clipped = local_work.ClippedGaussianSteps(10.0, 8.0, 5, 12).steps(0, np.arange(20_000), 1, clients, SIZES, B)
    assert clipped.min() == 5 and clipped.max() == 12
    # P(round(N(10, 64)) <= 5) = Phi((5.5 - 10) / 8)
    assert (clipped == 5).mean() == pytest.approx(0.2869, abs=0.01)
    assert clipped.dtype == np.int64


def test_fedavg_min_gives_everyone_the_round_minimum():
    inner = local_work.RandomSteps(1, 30)
    clients = _clients(50, k=5)
    tau = inner.steps(2, np.arange(50), 3, clients, SIZES, B)
    low = local_work.MinOfSelection(inner).steps(2, np.arange(50), 3, clients, SIZES, B)
    np.testing.assert_array_equal(low, np.repeat(tau.min(1, keepdims=True), 5, axis=1))
    assert len(np.unique(tau.min(1))) > 1  # the minimum is per replica


@pytest.mark.parametrize("overrides", [
    ("algorithm.local_work=random_steps", "algorithm.steps_low=2", "algorithm.steps_high=9"),
    ("algorithm.local_work=random_epochs", "algorithm.epochs_low=1", "algorithm.epochs_high=3"),
    ("algorithm.local_work=gaussian_steps", "algorithm.steps_mean=6", "algorithm.steps_std=3"),
    ("algorithm.local_work=random_steps", "algorithm.local_work_min=true"),
])
def test_engine_counts_exact_local_work(overrides, run_config):
    """The counters hold exactly the steps each distinct sampled client made, and the lr column is recorded."""
    cfg = run_config("dataset.num_clients=8", "algorithm.clients_per_round=4", "algorithm.batch_size=16",
                     "replicas=3", "rounds=4", *overrides)
    problem, algorithm, _ = prepare(cfg)
    engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver), rounds=4, seed=0, replicas=3,
                    eval_every=4)
    state = engine.initial_state()
    expected_steps, expected_evals = np.zeros(3), np.zeros(3)
    for rnd in range(4):
        plan, _ = engine.plan_round(rnd)
        tau = algorithm.local_work.steps(0, np.arange(3), rnd, plan.clients, problem.sizes, 16)
        np.testing.assert_array_equal(plan.tau, tau)
        for r in range(3):
            _, first = np.unique(plan.clients[r], return_index=True)  # a duplicate draw trains once
            expected_evals[r] += 16 * tau[r, first].sum()
        expected_steps += tau.max(1)
        state = engine.step(state)
    np.testing.assert_array_equal(state.counters["local_steps"], expected_steps)
    np.testing.assert_array_equal(state.counters["grad_evals"], expected_evals)


@pytest.mark.parametrize("local_work_name,override,key", [
    ("random_steps", "algorithm.steps_low=0", "algorithm.steps_low"),
    ("random_steps", "algorithm.steps_high=0", "algorithm.steps_high"),
    ("random_steps", "algorithm.steps_low=2.5", "algorithm.steps_low"),
    ("random_epochs", "algorithm.epochs_low=0", "algorithm.epochs_low"),
    ("random_epochs", "algorithm.epochs_high=1", "algorithm.epochs_high"),
    ("random_epochs", "algorithm.epochs_high=many", "algorithm.epochs_high"),
    ("gaussian_steps", "algorithm.steps_mean=0", "algorithm.steps_mean"),
    ("gaussian_steps", "algorithm.steps_std=-1", "algorithm.steps_std"),
    ("gaussian_steps", "algorithm.steps_min=0", "algorithm.steps_min"),
    ("gaussian_steps", "algorithm.steps_max=0", "algorithm.steps_max"),
    ("steps", "algorithm.local_work_min=maybe", "algorithm.local_work_min"),
    ("steps", "algorithm.local_steps=0", "algorithm.local_steps"),
    ("epochs", "algorithm.local_epochs=0", "algorithm.local_epochs"),
    ("sometimes", "algorithm.local_steps=1", "algorithm.local_work"),
])
def test_bad_local_work_values_name_the_key(local_work_name, override, key, run_config):
    with pytest.raises(ConfigError) as err:
        prepare(run_config("dataset=quadratic", f"algorithm.local_work={local_work_name}", override))
    assert err.value.key == key
