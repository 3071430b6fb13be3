"""Client-level DP (DP-FedAvg, algorithms/privacy.py): Poisson sampling, clipping in the shards, the noise on the sum
from the counter-based streams, the accountant's epsilon (dp-accounting), dp.target_epsilon, same bits at any shard
count, inline or on Ray, and on resume, and the bad input that is refused."""

from __future__ import annotations

import json

import dp_accounting
import numpy as np
import pyarrow.dataset as ds
import pytest
import torch

from closeness import EPS64
from fedharness.algorithms import accounting
from fedharness.algorithms.privacy import UNCLIPPED, ClipUpdates, DPFedAvg
from fedharness.algorithms.samplers import PoissonSampling
from fedharness.assembly.build import build_parts
from fedharness.cli import main
from fedharness.config.load import load_settings
from fedharness.contracts import Callback
from fedharness.core.executors import InlineExecutor, RoundPlan
from fedharness.core.stages import Stages
from fedharness.runs.execute import execute

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

DIGITS = ["dataset=digits", "algorithm.sampler=poisson", "rounds=5", "eval_every=1", "progress=false", "threads=1", "reference=off",
          "heterogeneity=false", "dp.noise_multiplier=1.0", "dp.clip_norm=1.0", "dp.delta=1e-5"]
COLUMNS = ("replica", "round", "train_loss", "test_loss", "test_acc", "epsilon", "dp_clip_norm", "local_steps",
           "grad_evals", "bytes_up")


def library_epsilon(kind: str, q: float, z: float, rounds: int, delta: float) -> float:
    """dp-accounting's own answer, composed here without the harness."""
    accountant = dp_accounting.rdp.RdpAccountant() if kind == "rdp" else dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    return accountant.compose(event, rounds).get_epsilon(delta)


def rounds_of(results_dir, run_id: str) -> list[tuple]:
    table = ds.dataset(results_dir / "rounds" / f"run_id={run_id}", format="parquet").to_table().to_pylist()
    return sorted(tuple(r[c] for c in COLUMNS) for r in table)


def run_row(results_dir, run_id: str) -> dict:
    return ds.dataset(results_dir / "runs" / f"run_id={run_id}", format="parquet").to_table().to_pylist()[0]


def run(tmp_path, run_id: str, *overrides: str, callbacks=()) -> str:
    settings = load_settings([f"results_dir={tmp_path}", *DIGITS, *overrides])
    return execute(settings, run_id=run_id, callbacks=callbacks).status


# --- the mechanism -------------------------------------------------------------------------------------------

def test_poisson_sampling_takes_each_client_with_probability_k_over_n_and_weighs_it_1_over_k():
    N, K, rounds = 50, 10, 400
    sampler = PoissonSampling(N, K)
    taken = np.zeros(N)
    sizes = []
    for rnd in range(rounds):
        sel = sampler.select(3, np.arange(4), rnd, np.full(N, 1 / N))
        for r in range(4):
            real = sel.weights[r] > 0
            ids = sel.clients[r][real]
            assert len(np.unique(ids)) == len(ids)  # no client twice
            np.testing.assert_array_equal(sel.weights[r][real], 1 / K)
            taken[ids] += 1
            sizes.append(len(ids))
            assert sel.active[r] == (len(ids) > 0)
            assert (sel.clients[r][~real] == (ids[0] if len(ids) else 0)).all()  # padding: weight 0, a sampled id
    # 1600 Bernoulli(0.2) draws per client: std of the share 0.01; the mean over 50 clients within 0.005 of q
    assert taken.mean() / (4 * rounds) == pytest.approx(K / N, abs=0.005)
    assert np.mean(sizes) == pytest.approx(K, rel=0.03)
    assert np.var(sizes) == pytest.approx(N * (K / N) * (1 - K / N), rel=0.15)  # Binomial(N, q)


def test_the_noise_std_is_z_clip_over_the_expected_clients_over_many_draws():
    z, clip, K = 1.3, 0.7, 10
    dp = DPFedAvg(z, clip, K, 0.1, 1e-5)
    draws = np.concatenate([dp.noise(0, np.arange(8), rnd, np.full(8, clip), 500).ravel() for rnd in range(50)])
    assert len(draws) == 200_000
    assert draws.std() == pytest.approx(z * clip / K, rel=0.02)
    assert abs(draws.mean()) < 3 * z * clip / K / np.sqrt(len(draws))
    # each replica and round its own draws, the same on a second call
    a, b = dp.noise(0, np.arange(2), 4, np.ones(2), 100), dp.noise(0, np.arange(2), 4, np.ones(2), 100)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a[0], a[1])


def test_adaptive_clipping_raises_the_update_noise_so_both_releases_are_one_gaussian_of_multiplier_z():
    dp = DPFedAvg(1.0, 1.0, 100, 0.1, 1e-5, adaptive=True)
    assert dp.count_noise == 5.0  # K / 20, as Andrew et al.
    assert (dp.update_noise ** -2 + (2 * dp.count_noise) ** -2) ** -0.5 == pytest.approx(1.0, rel=1e-12)
    counters = dp.init_counters(2)
    # every client unclipped: the share is about 1 > 0.5, so C shrinks by about exp(-0.2 * 0.5)
    dp.release(torch.zeros(2, 3, dtype=torch.float64), 0, np.arange(2), 0, np.array([100, 100]), counters)
    np.testing.assert_allclose(counters["dp_clip_norm"], np.exp(-0.2 * 0.5), rtol=0.15)


def test_the_shards_clip_each_update_before_the_weighted_sum():
    settings = load_settings(["dataset=digits", "reference=off", "algorithm.sampler=poisson", "replicas=2",
                              "dtype=float64", "algorithm.local_steps=5"])
    problem, algorithm = build_parts(settings)
    executor = InlineExecutor(problem, algorithm.solver, 3)
    x = problem.init_params(2, 0)
    sel = algorithm.sampler.select(0, np.arange(2), 0, problem.weights)
    tau = np.full(sel.clients.shape, 5)
    lrs = np.full(5, 0.05)
    plan = RoundPlan(0, 0, np.arange(2), sel.clients, sel.weights, tau, sel.lr_scale, lrs, send_updates=True)
    raw = executor.local_updates(x, plan).updates
    updates = {(int(r), int(k)): d.double() for c in raw for r, k, d in zip(c.replica, c.clients, c.delta)}
    norms = np.sort([float(d.norm()) for d in updates.values()])
    # about half the clients clipped, then most: each bound midway between two clients' norms, since the shards
    # compute the norms their own way (a row of a batch, not a vector alone) and a norm on a bound could count
    # either side. A norm of dim terms is within sum_rounding / (2 norm) + eps/2 <= dim eps norm of exact, so two
    # computations are within 2 dim eps norm: every gap to a bound must exceed that.
    half, quarter = len(norms) // 2, len(norms) // 4
    bound = np.array([norms[half - 1:half + 1].mean(), norms[quarter - 1:quarter + 1].mean()])
    assert np.abs(norms[:, None] - bound).min() > 2 * problem.dim * EPS64 * norms.max()
    clipped = executor.local_updates(x, RoundPlan(0, 0, np.arange(2), sel.clients, sel.weights, tau, sel.lr_scale,
                                                  lrs, stages=(ClipUpdates(bound),)))
    for r in range(2):
        want = sum((d * min(1.0, bound[r] / float(d.norm())) / 10 for (rr, _), d in updates.items() if rr == r))
        torch.testing.assert_close(clipped.delta[r], want, rtol=1e-9, atol=1e-12)
        # exact: a count, and no norm lies within rounding of a bound (checked above)
        assert clipped.counts[UNCLIPPED][r] == sum(float(d.norm()) <= bound[r] for (rr, _), d in updates.items() if rr == r)
    assert 0 < clipped.counts[UNCLIPPED].sum() < len(updates)


# --- the accountant --------------------------------------------------------------------------------------

@pytest.mark.parametrize("q,z,rounds", [(0.1, 1.0, 50), (0.01, 1.1, 1000)])
def test_rdp_and_pld_agree_within_the_rdp_conversions_slack(q, z, rounds):
    """Both are upper bounds on the true epsilon; PLD (pessimistic discretisation) is near tight, RDP's conversion
    to (epsilon, delta) is looser: here by 10-15%."""
    rdp = accounting.epsilon("rdp", q, z, rounds, 1e-5)
    pld = accounting.epsilon("pld", q, z, rounds, 1e-5)
    assert rdp == library_epsilon("rdp", q, z, rounds, 1e-5)
    assert pld == library_epsilon("pld", q, z, rounds, 1e-5)
    assert pld <= rdp <= 1.25 * pld


@pytest.mark.parametrize("kind", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])  # pld: ~10 s
def test_target_epsilon_is_reached_within_one_percent(kind):
    z = accounting.calibrate(kind, 0.05, 200, 1e-5, 2.0)
    assert library_epsilon(kind, 0.05, z, 200, 1e-5) == pytest.approx(2.0, rel=0.01)


# --- runs ------------------------------------------------------------------------------------------------

def test_a_dp_run_records_the_librarys_epsilon_after_every_evaluated_round(tmp_path):
    assert run(tmp_path, "dp") == "ok"
    rows = sorted(ds.dataset(tmp_path / "rounds", format="parquet").to_table().to_pylist(), key=lambda r: r["round"])
    config = json.loads(run_row(tmp_path, "dp")["config_json"])
    assert config["algorithm"]["sampler"] == "poisson"  # dp samples by Poisson unless a sampler is named
    q = config["algorithm"]["clients_per_round"] / config["dataset"]["num_clients"]
    eps = [r["epsilon"] for r in rows]
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert eps[0] == 0.0 and all(np.isfinite(eps)) and all(e > 0 for e in eps[1:])
    assert eps == sorted(eps)
    for r in rows[1:]:
        assert r["epsilon"] == library_epsilon("rdp", q, 1.0, r["round"], 1e-5)
    assert run_row(tmp_path, "dp")["epsilon"] == eps[-1]
    assert all(r["dp_clip_norm"] == 1.0 for r in rows)


@pytest.mark.slow  # the calibration's search takes ~10 s under load (each RDP evaluation at q = 0.2 is ~0.3 s)
def test_target_epsilon_calibrates_the_run_and_is_recorded(tmp_path):
    assert run(tmp_path, "target", "dp.noise_multiplier=null", "dp.target_epsilon=4",
               "algorithm.clients_per_round=4") == "ok"
    row = run_row(tmp_path, "target")
    assert row["epsilon"] == pytest.approx(4.0, rel=0.01)
    z = json.loads(row["config_json"])["dp"]["noise_multiplier"]
    assert row["epsilon"] == library_epsilon("rdp", 4 / 20, z, 5, 1e-5)


def test_a_run_without_dp_has_null_epsilon(tmp_path):
    settings = load_settings([f"results_dir={tmp_path}", "dataset=digits", "rounds=2", "progress=false",
                              "reference=off"])
    execute(settings, run_id="plain")
    rows = ds.dataset(tmp_path / "rounds", format="parquet").to_table().to_pylist()
    assert all(r["epsilon"] is None and r["dp_clip_norm"] is None for r in rows)
    assert run_row(tmp_path, "plain")["epsilon"] is None


def test_the_noise_reaches_the_model(tmp_path):
    """z = 0 against z = 4, same clipping and sampling: the same start, different models after the rounds."""
    run(tmp_path, "z0", "dp.noise_multiplier=0", "dtype=float64")
    run(tmp_path, "z4", "dp.noise_multiplier=4", "dtype=float64")
    a, b = rounds_of(tmp_path, "z0"), rounds_of(tmp_path, "z4")
    assert a[0][2] == b[0][2] and a[-1][2] != b[-1][2]
    assert all(r[5] is None for r in a if r[1] > 0)  # no noise: epsilon infinite after round 0, recorded null


class StopAt(Callback):
    def __init__(self, at: int):
        self.at = at

    def on_round_end(self, context):
        return context.round == self.at


def test_adaptive_clipping_gives_the_same_rows_at_any_shard_count_and_on_resume(tmp_path):
    adaptive = ["dp.adaptive=true", "dp.count_noise_multiplier=1", "dp.clip_norm=0.5", "replicas=2", "rounds=6",
                "eval_every=2"]
    assert run(tmp_path, "one", *adaptive) == "ok"
    assert run(tmp_path, "three", *adaptive, "num_shards=3") == "ok"
    one = rounds_of(tmp_path, "one")
    assert rounds_of(tmp_path, "three") == one
    assert len({r[6] for r in one}) > 2  # the clip norm moved
    assert run(tmp_path, "cut", *adaptive, "checkpoint_every=2", callbacks=[StopAt(3)]) == "stopped"
    resumed = load_settings([f"results_dir={tmp_path}", *DIGITS, *adaptive, "checkpoint_every=2", "resume=cut"])
    assert execute(resumed).status == "ok"
    assert rounds_of(tmp_path, "cut") == one


@pytest.mark.slow
def test_ray_shards_give_the_inline_rows(local_ray, tmp_path):
    assert run(tmp_path, "inline", "replicas=2") == "ok"
    assert run(tmp_path, "ray", "replicas=2", "executor=ray", "ray.num_shards=2") == "ok"
    assert rounds_of(tmp_path, "ray") == rounds_of(tmp_path, "inline")


# --- bad input -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key", [
    (["algorithm.sampler=scheme_i"], "algorithm.sampler"),
    (["dp.delta=0"], "dp.delta"),
    (["dp.delta=1"], "dp.delta"),
    (["dp.delta=1.5"], "dp.delta"),
    (["algorithm=fedavg_median"], "algorithm.aggregator"),
    (["dp.target_epsilon=2"], "dp.target_epsilon"),
    (["dp.adaptive=true", "dp.count_noise_multiplier=0.4"], "dp.count_noise_multiplier"),
])
def test_bad_dp_input_is_one_line_exit_2_and_nothing_written(overrides, key, tmp_path, capsys):
    results = tmp_path / "out"
    assert main(["run", f"results_dir={results}", *DIGITS, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{key}'" in err, err
    assert not results.exists()


@pytest.mark.parametrize("kind", ["rdp", pytest.param("pld", marks=pytest.mark.slow)])  # pld: ~7 s
def test_a_studys_trials_compose_as_one_run_of_all_their_rounds(kind):
    """Three trials of 20 rounds each cost what one run of 60 rounds costs (same q and z), more than one trial."""
    trials = accounting.composed_epsilon(kind, [(0.1, 1.2, 20)] * 3, 1e-5)
    assert trials == pytest.approx(library_epsilon(kind, 0.1, 1.2, 60, 1e-5), rel=1e-3)
    assert trials > library_epsilon(kind, 0.1, 1.2, 20, 1e-5)
    assert accounting.composed_epsilon(kind, [(0.1, 0.0, 5)], 1e-5) == float("inf")


def test_dp_runs_batched_as_slots_give_their_solo_rows(tmp_path):
    """Tuning trials and sweep points train as slots of one batched run: each slot's noise, clip norm and epsilon
    are those of the same run alone (its own seed's streams, its own replicas)."""
    from fedharness.runs.batch import Slot
    from fedharness.runs.execute import execute_batch

    common = [f"results_dir={tmp_path}", *DIGITS, "dataset.data_seed=0", "dp.adaptive=true",
              "dp.count_noise_multiplier=1", "dp.clip_norm=0.5", "rounds=4", "eval_every=2"]
    slots = [Slot(load_settings([*common, f"seed={seed}", f"algorithm.client_lr={lr}"]), run_id=f"slot{seed}")
             for seed, lr in ((1, 0.05), (2, 0.1))]
    assert [r.status for r in execute_batch(slots)] == ["ok", "ok"]
    for slot in slots:
        assert execute(slot.settings, run_id=f"alone{slot.run_id}").status == "ok"
        assert rounds_of(tmp_path, slot.run_id) == rounds_of(tmp_path, f"alone{slot.run_id}")


def test_a_batch_calibrating_one_noise_multiplier_refuses_slots_of_different_rounds(tmp_path):
    from fedharness.errors import ConfigError
    from fedharness.runs.batch import check_batch

    common = [f"results_dir={tmp_path}", *DIGITS, "dp.noise_multiplier=null", "dp.target_epsilon=2"]
    with pytest.raises(ConfigError, match="'rounds'"):
        check_batch([load_settings([*common, "rounds=4"]), load_settings([*common, "rounds=6"])])
    check_batch([load_settings([*common, "rounds=4", "seed=1", "dataset.data_seed=0"]),
                 load_settings([*common, "rounds=4", "seed=2", "dataset.data_seed=0"])])
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # two trials of up to 60 rounds and Optuna's storage: ~20 s under load
def test_a_tuning_study_reports_what_all_its_dp_trials_spent_together(tmp_path, capsys):
    args = ["tune", "tune=default", "dataset=digits", "algorithm=dp_fedavg", "dp.noise_multiplier=1.0", "tune.n_trials=2", "tune.plots=false",
            "tune.budget.total=60", "tune.sampler.name=random", "progress=false", "reference=off",
            f"results_dir={tmp_path}"]
    assert main(args) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if "privacy:" in x]
    runs = ds.dataset(tmp_path / "runs", format="parquet").to_table().to_pylist()
    assert len(runs) == 2 and all(r["epsilon"] > 0 for r in runs)
    event = dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(10 / 20, dp_accounting.GaussianDpEvent(1.0)), r["rounds_done"])
        for r in runs])
    want = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert want > max(r["epsilon"] for r in runs)
    assert line == [f"  privacy: the 2 DP trials together spent epsilon = {want:.4g} at delta = 1e-05 (rdp; each "
                    "trial's own epsilon is in runs/)"]


def test_the_engine_adds_exactly_the_mechanisms_noise_once_per_round():
    """The same round with z = 1.5 and with z = 0 (same clipping and sample): the models differ by exactly the noise
    DPFedAvg.noise draws for (seed, replica, round), std z C / K (the server's sgd step has lr 1)."""
    from fedharness.assembly.privacy import privacy_for
    from fedharness.core.engine import Engine

    def one_round(z: float):
        settings = load_settings([*DIGITS, f"dp.noise_multiplier={z}", "dtype=float64", "replicas=3", "seed=7"])
        problem, algorithm = build_parts(settings)
        privacy = privacy_for(settings, problem)
        engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 2), rounds=1, seed=7,
                        replicas=3, eval_every=1, stages=Stages([privacy]))
        state = engine.initial_state()
        return engine.step(state).x, privacy, problem.dim

    noisy, privacy, dim = one_round(1.5)
    clean, _, _ = one_round(0.0)
    want = privacy.noise(7, np.arange(3), 0, np.ones(3), dim)
    np.testing.assert_allclose((noisy - clean).numpy(), want, rtol=1e-9, atol=1e-12)
    assert want.std() == pytest.approx(1.5 * 1.0 / 10, rel=0.05)  # 1950 draws: 5% is 3 standard errors


# --- adaptive clipping's two releases, observed on what the product adds (issue 35) ------------------------

def andrew_update_multiplier(z: float, sigma_b: float) -> float:
    """Andrew et al. 2021, Theorem 1: with the unclipped count released at noise sigma_b, the update's multiplier
    z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) makes both releases together one Gaussian mechanism of multiplier z."""
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5


def test_with_adaptive_clipping_the_engine_adds_the_raised_noise_of_the_closed_form():
    """One round with z = 1.5, sigma_b = 1 against z = 0 (same clip norm, clipping and sample): the models differ
    by the unit-multiplier draws for (seed, replica, round) times z_Delta C / K, z_Delta = 2.27 from the closed
    form, not z = 1.5 (an under-noised release). The unit draws come from a mechanism without adaptive clipping."""
    from fedharness.assembly.privacy import privacy_for
    from fedharness.core.engine import Engine

    def one_round(z: float):
        settings = load_settings([*DIGITS, f"dp.noise_multiplier={z}", "dtype=float64", "replicas=3", "seed=7",
                                  "dp.adaptive=true", "dp.count_noise_multiplier=1"])
        problem, algorithm = build_parts(settings)
        engine = Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, 2), rounds=1, seed=7,
                        replicas=3, eval_every=1, stages=Stages([privacy_for(settings, problem)]))
        return engine.step(engine.initial_state()).x, problem.dim

    noisy, dim = one_round(1.5)
    clean, _ = one_round(0.0)
    z_delta = andrew_update_multiplier(1.5, 1.0)
    assert z_delta == pytest.approx(2.268, abs=1e-3)
    unit = DPFedAvg(1.0, 1.0, 10, 0.5, 1e-5).noise(7, np.arange(3), 0, np.ones(3), dim)  # std 1 * C / K
    added = (noisy - clean).numpy()
    np.testing.assert_allclose(added, z_delta * unit, rtol=1e-9, atol=1e-12)
    assert added.std() == pytest.approx(z_delta * 1.0 / 10, rel=0.05)  # 1950 draws: 5% is 3 standard errors


def test_the_released_unclipped_count_has_noise_of_std_sigma_b_over_k():
    """The clip norm's step reveals the released share b = (unclipped + N(0, sigma_b^2)) / K: C' = C exp(-lr (b -
    target)). Over 4,000 replicas with the same true count, b's spread is sigma_b / K (here 0.15) and its mean the
    true share; a count released without noise would not spread at all."""
    K, sigma_b, lr, target, R = 20, 3.0, 0.2, 0.5, 4000
    dp = DPFedAvg(1.0, 1.0, K, 0.1, 1e-5, adaptive=True, target_quantile=target, clip_lr=lr,
                  count_noise_multiplier=sigma_b)
    counters = dp.init_counters(R)
    dp.release(torch.zeros(R, 1, dtype=torch.float64), 0, np.arange(R), 3, np.full(R, 12), counters)
    share = target - np.log(counters["dp_clip_norm"] / 1.0) / lr
    # 4,000 draws: the std's standard error is 1.1%, the mean's 0.0024
    assert share.std() == pytest.approx(sigma_b / K, rel=0.05)
    assert share.mean() == pytest.approx(12 / K, abs=0.01)
    again = dp.init_counters(R)  # the same streams: the same released counts
    dp.release(torch.zeros(R, 1, dtype=torch.float64), 0, np.arange(R), 3, np.full(R, 12), again)
    np.testing.assert_array_equal(again["dp_clip_norm"], counters["dp_clip_norm"])
