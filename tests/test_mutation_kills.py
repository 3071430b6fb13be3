"""Tests that kill mutants `make mutants` found alive (docs/mutation.md lists each survivor and its test)."""

from __future__ import annotations

import dataclasses
import math
import pickle
from types import SimpleNamespace

import numpy as np
import optuna
import pytest
import torch

from fedharness.algorithms import accounting, attacks, privacy, robust, samplers
from fedharness.base import streams
from fedharness.core import exact_sum
from fedharness.algorithms.byzantine import Adversary, byzantine_mask, forge_updates
from fedharness.contracts import RoundPlan, UpdateChunk
from fedharness.studies.tuning.optuna_parts import ask_trial, make_sampler, open_study
from fedharness.studies.tuning.spec import build_spec

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too


def test_a_run_of_no_rounds_spends_nothing_in_a_composition_even_without_noise():
    """A trial pruned before its first round released nothing: it adds nothing to what a study spent, even at z = 0
    (alone, z = 0 is an infinite epsilon). Kills `rounds >= 0` for `rounds > 0` in composed_epsilon."""
    alone = accounting.epsilon("rdp", 0.1, 1.0, 10, 1e-5)
    assert accounting.composed_epsilon("rdp", [(0.1, 0.0, 0), (0.1, 1.0, 10)], 1e-5) == alone
    assert accounting.composed_epsilon("rdp", [(0.1, 0.0, 0)], 1e-5) == 0.0


def test_final_epsilon_is_the_accountants_at_rate_k_over_n_and_none_without_dp_or_without_noise():
    """What a run's record states as its epsilon (runs/lifecycle.py). Kills the mutants of privacy.final_epsilon:
    K/N as K*N, the enabled check negated, the finiteness check negated."""
    dp = SimpleNamespace(enabled=True, accountant="rdp", noise_multiplier=1.0, delta=1e-5)
    spent = privacy.final_epsilon(dp, 100, 10, 20)
    assert spent == accounting.epsilon("rdp", 0.1, 1.0, 20, 1e-5)
    assert 0 < spent < math.inf
    assert privacy.final_epsilon(SimpleNamespace(**{**vars(dp), "noise_multiplier": 0.0}), 100, 10, 20) is None
    assert privacy.final_epsilon(SimpleNamespace(**{**vars(dp), "enabled": False}), 100, 10, 20) is None


def test_the_mechanisms_parameters_cannot_change_after_it_is_built():
    """The accountant charges the z the mechanism was built with: no code may lower it during a run. Kills
    @dataclass(frozen=False) on DPFedAvg."""
    mechanism = privacy.DPFedAvg(1.0, 1.0, 10, 0.1, 1e-5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mechanism.noise_multiplier = 0.0


def test_a_poisson_replica_that_draws_nobody_is_inactive_and_every_other_active():
    """A replica with an empty Poisson sample moves nothing (Selection.active False), one with clients moves.
    Kills `counts >= 0` for `counts > 0` in PoissonSampling.select."""
    sel = samplers.PoissonSampling(1000, 1).select(0, np.arange(40), 0, np.full(1000, 1e-3))
    drew = (sel.weights > 0).any(axis=1)
    assert 0 < drew.sum() < 40  # both occur: a replica draws nobody with probability 0.999^1000 = 0.37
    assert np.array_equal(sel.active, drew)


def test_without_replacement_beyond_the_shuffle_size_draws_k_distinct_clients():
    """Above SHUFFLE_MAX_CLIENTS the K clients are the first K distinct of a stream of uniform draws. Kills
    `while False` in _distinct_uniform."""
    N = 1 << 18
    clients = samplers.YangStrategy2(N, 10).select(0, np.arange(3), 0, np.full(N, 1 / N)).clients
    assert clients.shape == (3, 10)
    assert all(len(set(row)) == 10 for row in clients.tolist())
    assert clients.min() >= 0 and clients.max() < N


def test_dropout_wraps_the_sampler_only_when_its_rate_is_positive():
    """algorithm.dropout > 0 puts Dropout around the sampler; 0 leaves the sampler as it is. Kills the negated
    test in with_dropout."""
    inner = samplers.YangStrategy2(10, 5)
    assert samplers.with_dropout(inner, 0.0) is inner
    wrapped = samplers.with_dropout(inner, 0.5)
    assert isinstance(wrapped, samplers.Dropout) and wrapped.rate == 0.5 and wrapped.sampler is inner


def test_a_sum_converted_in_several_column_chunks_is_within_the_documented_precision():
    """Terms of more than _CHUNK elements are converted a slice of columns at a time (the path a large model's
    reply takes). Kills `/` for `//` in the chunk width and the negated `whole` in add_rows."""
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(2, 3 * exact_sum.BLOCK, dtype=torch.float64, generator=gen)
    # within the block's largest reference value: every chunk takes the low word's path
    terms = (2 * torch.rand(300, 3 * exact_sum.BLOCK, dtype=torch.float64, generator=gen) - 1) * reference.abs().amin()
    index = torch.arange(300) % 2
    assert terms.numel() > 3 * exact_sum._CHUNK  # several chunks
    grid = exact_sum.Grid.of(reference, 150)
    total = exact_sum.ExactSum.zeros(tuple(reference.shape)).add_rows(index, terms, grid).value(grid)
    expected = torch.zeros_like(reference).index_add_(0, index, terms)
    # each term moves by at most g / 2 (docs in exact_sum.py); 150 terms a row
    assert bool(((total - expected).abs() <= 150 * 0.5 / grid.scale).all())
    assert bool((total != 0).all())


def test_a_sum_pickled_as_ray_sends_it_or_moved_arrives_whole_and_counts_its_bytes():
    """A shard's reply crosses Ray pickled (NumpyWire) and is moved between devices: its words, high and overflow
    included, arrive equal; nbytes counts 8 bytes a word. Kills the negated `is None` in NumpyWire.__getstate__
    and ExactSum.to, the emptied loop in __setstate__, `/` for `*` in nbytes."""
    reference = torch.ones(1, 4, dtype=torch.float64)
    grid = exact_sum.Grid.of(reference, 2)
    terms = torch.tensor([[1.5, -2.0, 2.0 ** 60, float("inf")], [0.25, 0.5, 1.0, 1.0]], dtype=torch.float64)
    reply = exact_sum.ExactSum.zeros((1, 4)).add_rows(torch.zeros(2, dtype=torch.long), terms, grid)
    assert reply.high is not None and reply.overflow is not None
    arrived = pickle.loads(pickle.dumps(reply))
    assert torch.equal(arrived.value(grid), reply.value(grid))
    assert torch.equal(arrived.low, reply.low) and torch.equal(arrived.high, reply.high)
    moved = reply.to("cpu")
    assert torch.equal(moved.high, reply.high) and torch.equal(moved.overflow, reply.overflow)
    assert reply.nbytes == 3 * 4 * 8  # low, high and overflow: 4 float64 words each
    assert exact_sum.FloatSum.zeros((2, 3)).nbytes == 2 * 3 * 8


def test_terms_within_the_margin_travel_in_the_low_word_alone_and_the_words_are_the_documented_ones():
    """A round whose terms stay within 2^MARGIN_BITS of the block's reference sends 8 bytes a parameter (no high
    word), and L = 53 - bitlength(K) for both words. Kills the low word's bounds turned into 2 L or +2^L, and
    WORD_BITS + head for the high word's bits."""
    for width in (5, 2 * exact_sum.BLOCK):  # one block, several
        for K in (1, 10, 1000):
            grid = exact_sum.Grid.of(torch.ones(1, width, dtype=torch.float64), K)
            assert grid.low_bits == grid.high_bits == 53 - K.bit_length()
    reference = torch.ones(1, 5, dtype=torch.float64)
    grid = exact_sum.Grid.of(reference, 10)
    terms = torch.tensor([[3.9, -3.9, 0.0, 1e-9, -2.5]] * 10, dtype=torch.float64)
    reply = exact_sum.ExactSum.zeros((1, 5)).add_rows(torch.zeros(10, dtype=torch.long), terms, grid)
    assert reply.high is None and reply.overflow is None and reply.nbytes == 5 * 8


def test_each_named_sum_gets_the_grid_of_what_it_updates():
    """Grids: "delta" on the model x, a solver's sum on its server tensor, any other on zeros (the FLOOR_EXP
    step). Kills `is not None` for `is None` and its negation in Grids.__getitem__."""
    x = torch.full((2, 8), 3.0, dtype=torch.float64)
    control = torch.full((2, 8), 1e3, dtype=torch.float64)
    grids = exact_sum.Grids(x, {"control": control}, 10)
    assert torch.equal(grids["delta"].scale, exact_sum.Grid.of(x, 10).scale)
    assert torch.equal(grids["control"].scale, exact_sum.Grid.of(control, 10).scale)
    assert torch.equal(grids["other"].scale, exact_sum.Grid.of(torch.zeros_like(x), 10).scale)
    assert not torch.equal(grids["delta"].scale, grids["other"].scale)


@pytest.mark.parametrize("key,refused,accepted", [("trim", 0.5, 0.49), ("clip_norm", 0.0, 1e-9),
                                                  ("rfa_nu", 0.0, 1e-9), ("cc_tau", 0.0, 1e-9)])
def test_the_robust_rules_refuse_their_degenerate_settings(key, refused, accepted):
    """trim 0.5 drops every update, a zero clip norm or tau moves nothing, nu 0 divides by a zero distance: each
    key's bound is open. Kills lo_open/hi_open=False in robust.KEYS."""
    assert not robust.KEYS[key].check(refused)
    assert robust.KEYS[key].check(accepted)


def test_buckets_of_one_leave_the_updates_and_their_order_as_they_are():
    """bucket_size 1 is no bucketing: the rule sees the updates themselves, in their order; so does a single update
    (not its weighted mean, 0.1 * 3 / 0.1 = 3.0000000000000004). Kills `size < 1`, `n < 1` and `and` for `or` in
    robust.bucket."""
    updates = torch.full((5, 3), 3.0, dtype=torch.float64) + torch.arange(5, dtype=torch.float64)[:, None]
    weights = torch.full((5,), 0.1, dtype=torch.float64)
    key = streams.stream_key(0, streams.BUCKETS, 0, 0, 0)
    rows, w = robust.bucket(updates, weights, 1, key)
    assert torch.equal(rows, updates) and torch.equal(w, weights)
    rows, w = robust.bucket(updates[:1], weights[:1], 2, key)
    assert torch.equal(rows, updates[:1]) and torch.equal(w, weights[:1])


def test_krum_breaks_ties_towards_the_lower_row():
    """Krum's documented tie rule (the lower row), on 20 updates +-e_i whose scores are all equal (integer
    distances, so exactly): the first row wins. torch's unstable sort reorders ties from 17 elements on. Kills
    argsort(stable=False)."""
    eye = torch.eye(10, dtype=torch.float64)
    updates = torch.cat([eye, -eye])
    chosen = robust.Krum(byzantine=0, krum_select=1).aggregate(updates, torch.full((20,), 0.05, dtype=torch.float64))
    assert torch.equal(chosen, updates[0])


@pytest.mark.parametrize("keys,key", [(attacks.GAUSSIAN_KEYS, "noise_std"), (attacks.IPM_KEYS, "epsilon")])
def test_the_attacks_refuse_a_zero_strength(keys, key):
    """A Gaussian attack of std 0 or an IPM attack of epsilon 0 sends nothing and is no attack: both bounds are
    open. Kills lo_open=False in GAUSSIAN_KEYS and IPM_KEYS."""
    assert not keys[key].check(0.0)
    assert keys[key].check(1e-9)


def test_an_update_attacks_adversary_leaves_the_training_labels_alone():
    """assembly/build.py builds an update attack's Adversary without flips_labels: its Byzantine clients train
    honestly and only their updates are forged (label_flip alone poisons the training). Kills the default True."""
    adversary = Adversary(attacks.InnerProductManipulation(), 0.2)
    assert adversary.flips_labels is False
    with pytest.raises(dataclasses.FrozenInstanceError):  # and nothing changes it during the run
        adversary.fraction = 0.0


def test_a_replica_without_byzantine_clients_leaves_the_next_replicas_forged():
    """Replica 0 has one returned client (floor(0.5 x 1) = 0 Byzantine), replica 1 two (one Byzantine): replica 1's
    Byzantine row must still be forged (sign_flip: negated) and every other row left as sent. Kills `break` for
    `continue` after a replica without Byzantine clients in forge_updates."""
    plan = RoundPlan(round=3, seed=11, stream_replicas=np.array([0, 1]), clients=np.array([[3, 7], [2, 5]]),
                     coef=np.array([[1.0, 0.0], [0.5, 0.5]]), tau=np.ones((2, 2), dtype=np.int64),
                     lr_scale=np.ones((2, 2)), step_lrs=np.array([0.1]), send_updates=True)
    sent = torch.tensor([[1.0, -2.0], [3.0, 4.0], [-5.0, 6.0]], dtype=torch.float64)
    chunk = UpdateChunk(np.array([0, 1, 1]), np.array([3, 2, 5]), sent.clone())
    bad = byzantine_mask(0.5, 11, 1, 3, np.array([2, 5]))  # replica 1's returned clients, ascending
    assert bad.sum() == 1 and not byzantine_mask(0.5, 11, 0, 3, np.array([3])).any()
    forge_updates(Adversary(attacks.SignFlip(), 0.5), plan, [chunk])
    expected = sent.clone()
    expected[1:][torch.as_tensor(bad)] *= -1.0  # by hand: the Byzantine row negated, the others as sent
    assert torch.equal(chunk.delta, expected)


def test_alie_with_one_honest_update_sends_that_update():
    """One honest update has no spread (std 0), so ALIE sends it, not torch.std's NaN of one row. Kills `>= 1` for
    `> 1` in ALittleIsEnough.forge."""
    honest = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
    own = torch.zeros(2, 3, dtype=torch.float64)
    forged = attacks.ALittleIsEnough(z=1.5).forge(own, honest, np.zeros(2, dtype=np.uint64))
    assert torch.equal(forged, honest.expand(2, -1))


@pytest.mark.parametrize("cls", [samplers.SchemeI, samplers.YangStrategy1, samplers.SchemeII, samplers.YangStrategy2])
def test_each_sampler_declares_with_replacement_as_it_draws(cls):
    """`with_replacement` (read by core/slots.py) says whether a round may draw a client twice: true exactly for
    the samplers whose draws repeat. Kills with_replacement = False on YangStrategy1."""
    N = 3
    K = 12 if cls.with_replacement else N
    clients = cls(N, K).select(0, np.arange(4), 0, np.full(N, 1 / N)).clients
    repeats = any(len(set(row)) < len(row) for row in clients.tolist())
    assert repeats == (cls in (samplers.SchemeI, samplers.YangStrategy1))
    assert cls.with_replacement == repeats


TUNE = ["tune=default", "dataset=quadratic", "algorithm.clients_per_round=4", "dtype=float32", "tune.budget.total=40",
        "tune.space.local_steps.high=4", "tune.plots=false", "tune.n_trials=20"]


def test_ask_trial_runs_an_enqueued_trial_first_only_when_the_study_may_hold_some():
    """queued=False skips Optuna's look for enqueued trials (a batch's cost); queued=True runs them first, with
    their own number and parameters. Kills `not queued` in ask_trial."""
    spec = build_spec(TUNE, probe=False)
    study = optuna.create_study(direction="minimize")
    study.enqueue_trial({"client_lr": 0.0123, "local_steps": 3})  # trial 0, waiting
    assert ask_trial(spec, study, 0, queued=False).number == 1
    enqueued = ask_trial(spec, study, 0, queued=True)
    assert enqueued.number == 0
    assert {p.name: p.suggest(enqueued) for p in spec.params} == {"client_lr": 0.0123, "local_steps": 3}


def test_cmaes_without_batches_keeps_its_own_population_size_past_the_startup_trials():
    """tune.batch=1 leaves CMA-ES its default population (4 + 3 ln n); a population of 1 fails on its first
    model-based proposal (cmaes: "invalid learning rate for the rank-one update"). Kills `batch >= 1` for
    `batch > 1` in make_sampler."""
    spec = build_spec([*TUNE, "tune.sampler.name=cmaes"], probe=False)
    assert spec.batch == 1 and spec.startup_trials < 14
    study = optuna.create_study(direction="minimize", sampler=make_sampler(spec, 0))
    study.optimize(lambda t: (math.log10(t.suggest_float("client_lr", 1e-3, 1.0, log=True)) + 1) ** 2
                   + t.suggest_int("local_steps", 1, 4), n_trials=14)
    assert len(study.trials) == 14 and all(t.state.name == "COMPLETE" for t in study.trials)


def test_a_worker_opens_only_a_study_that_exists(tmp_path):
    """The driver creates the study and records its objective and budget (study.py, create=True); a worker or
    --compare only loads it, so a worker started against a missing study fails instead of creating one. Kills
    `create: bool = True` as open_study's default."""
    spec = build_spec([*TUNE, f"results_dir={tmp_path}"], probe=False)
    with pytest.raises(KeyError):
        open_study(spec, 1)
    created = open_study(spec, 0, create=True)
    assert open_study(spec, 1).study_name == created.study_name


def test_clip_rows_scales_down_to_the_bound_and_counts_a_norm_equal_to_it_as_within():
    """DP's clipping (algorithms/privacy.py clip_rows, moved out of the shards with issue 37): a row of norm 10 is
    scaled to the bound 5, a row of norm exactly 5 is left alone and counted within it (the adaptive clip norm's
    quantile counts norm <= C). Kills `/` for `*` in the scaling, `*` for `/` in the scale, and `<` for `<=`."""
    rows = torch.tensor([[3.0, 4.0], [6.0, 8.0], [0.3, 0.4]], dtype=torch.float64)
    clipped, within = privacy.clip_rows(rows, np.array([5.0, 5.0, 5.0]))
    assert torch.equal(clipped, torch.tensor([[3.0, 4.0], [3.0, 4.0], [0.3, 0.4]], dtype=torch.float64))
    assert within.tolist() == [True, False, True]


def test_a_rounds_clipping_work_cannot_change_on_its_way_to_the_shards():
    """ClipUpdates travels with the round's plan to every shard: frozen, as the plan's other parts. Kills
    frozen=False."""
    work = privacy.ClipUpdates(np.array([1.0]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        work.bound = np.array([2.0])


def test_an_update_attack_as_a_stage_forges_and_label_flipping_passes_the_updates_on():
    """The attack stage (algorithms/byzantine.py Adversary.on_updates, issue 37): sign_flip's Byzantine row comes
    back negated; label_flip's updates come back as sent (its poison is in the training). Kills `not` added to
    the flips_labels test in on_updates."""
    plan = RoundPlan(round=3, seed=11, stream_replicas=np.array([0]), clients=np.array([[2, 5]]),
                     coef=np.array([[0.5, 0.5]]), tau=np.ones((1, 2), dtype=np.int64), lr_scale=np.ones((1, 2)),
                     step_lrs=np.array([0.1]), send_updates=True)
    sent = torch.tensor([[1.0, -2.0], [3.0, 4.0]], dtype=torch.float64)
    bad = byzantine_mask(0.5, 11, 0, 3, np.array([2, 5]))
    assert bad.sum() == 1
    forged = Adversary(attacks.SignFlip(), 0.5).on_updates(plan, [UpdateChunk(np.array([0, 0]), np.array([2, 5]),
                                                                              sent.clone())])
    expected = sent.clone()
    expected[torch.as_tensor(bad)] *= -1.0
    assert torch.equal(forged[0].delta, expected)
    flipped = Adversary(attacks.LabelFlip(), 0.5).on_updates(plan, [UpdateChunk(np.array([0, 0]), np.array([2, 5]),
                                                                                sent.clone())])
    assert torch.equal(flipped[0].delta, sent)


def test_the_poisoned_clients_work_cannot_change_on_its_way_to_the_shards():
    """PoisonedClients travels with the round's plan to every shard: frozen. Kills frozen=False."""
    from fedharness.algorithms.byzantine import PoisonedClients

    work = PoisonedClients(np.zeros((1, 2), dtype=bool), np.array([[2, 5]]), attacks.LabelFlip())
    with pytest.raises(dataclasses.FrozenInstanceError):
        work.poisoned = np.ones((1, 2), dtype=bool)
