"""dataset.unseen_clients (problems/unseen.py) and per-client evaluation's coverage: every client evaluated when
eval.clients is null, the sampled estimate's standard error calibrated, unseen clients never selected, F* the
training clients' alone, their metrics recorded apart (the refusals: tests/test_personal_eval.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedharness.contracts import ClientScores
from fedharness.core.executors import InlineExecutor
from fedharness.problems import build_problem
from fedharness.problems.client_eval import evaluated_clients
from fedharness.problems.unseen import unseen_order
from fedharness.runs.execute import build_engine, execute, prepare_run

N = 20
QUADRATIC = ["dataset=quadratic", f"dataset.num_clients={N}", "dataset.dim=4", "dataset.curvature=random",
             "dataset.mu=0.5", "dataset.L=2", "dataset.unseen_clients=0.25", "dtype=float64", "rounds=30",
             "eval_every=10", "algorithm.sampler=scheme_ii", "algorithm.clients_per_round=5",
             "algorithm.local_steps=3", "algorithm.client_lr=0.1", "reference=on", "heterogeneity=false",
             "eval.personal=[global,finetune]", "eval.clients_table=true"]
UNSEEN = 5  # floor(0.25 N)


def test_unseen_clients_are_never_selected_and_leave_f_star(run_config):
    run = prepare_run(run_config(*QUADRATIC, "replicas=3"))
    problem = run.problem
    order, training = unseen_order(run.settings.data_seed, N, 0.25)
    assert training == N - UNSEEN and problem.training_clients == training
    whole = prepare_run(run_config(*QUADRATIC, "dataset.unseen_clients=0")).problem
    assert np.array_equal(problem.e_np, whole.e_np[order])  # the same clients, the unseen ones numbered last
    engine = build_engine(run, InlineExecutor(problem, run.algorithm.solver))
    drawn = np.concatenate([engine.plan_round(rnd)[0].clients.reshape(-1) for rnd in range(1, 31)])
    assert drawn.max() < training and len(np.unique(drawn)) == training  # every training client, no unseen one
    # the reference solved on the training clients alone (numbered first: problems/unseen.py)
    A, e = problem.A_np[:training], problem.e_np[:training]
    w_star = np.linalg.solve(A.sum(0), np.einsum("nde,ne->d", A, e))
    f_star = np.mean([0.5 * (w_star - ek) @ Ak @ (w_star - ek) for Ak, ek in zip(A, e)])
    # the solver's w*, F* against numpy's solve: both float64, a 4x4 system of condition <= L/mu = 4: ~1e-15
    assert np.abs(np.asarray(run.reference.w_star) - w_star).max() < 1e-10 * np.abs(w_star).max()
    assert abs(run.reference.f_star - f_star) < 1e-10 * f_star
    everyone = np.linalg.solve(problem.A_np.sum(0), np.einsum("nde,ne->d", problem.A_np, problem.e_np))
    assert np.abs(everyone - w_star).max() > 1e-3  # all N clients' optimum is elsewhere: the check can fail


def test_full_participation_trains_every_training_client_and_no_unseen_one(run_config):
    """algorithm.sampler=full with unseen clients once failed to broadcast all N weights over the training ones."""
    run = prepare_run(run_config(*QUADRATIC, "algorithm.sampler=full"))
    engine = build_engine(run, InlineExecutor(run.problem, run.algorithm.solver))
    training = N - UNSEEN
    assert np.array_equal(engine.plan_round(1)[0].clients, np.arange(training)[None])
    chosen = run.algorithm.sampler.select(0, np.arange(2), 1, run.problem.weights)
    assert np.array_equal(chosen.weights, np.tile(run.problem.weights[:training], (2, 1)))  # exact: copied
    assert run.problem.weights[training:].sum() == 0  # exact: the unseen clients weigh nothing


def test_every_client_is_evaluated_and_the_unseen_recorded_apart(run_config, tmp_path):
    result = execute(run_config(*QUADRATIC))
    clients = pd.read_parquet(tmp_path / "results" / "clients")
    for (rnd, protocol), group in clients.groupby(["round", "protocol"]):  # eval.clients null: each client, once
        assert sorted(group["client"]) == list(range(N)) and (protocol == "global" or rnd == 30)
    assert set(clients["protocol"]) == {"global", "finetune"}  # fine-tuned at the last evaluation only
    last = result.rows[-1]
    tuned = clients[(clients["round"] == 30) & (clients["protocol"] == "finetune")].set_index("client")["loss"]
    assert last["unseen_client_loss_finetune_mean"] == pytest.approx(tuned[tuned.index >= N - UNSEEN].mean(),
                                                                     rel=1e-12)
    final = clients[(clients["round"] == 30) & (clients["protocol"] == "global")].set_index("client")["loss"]
    assert last["client_loss_mean"] == pytest.approx(final[final.index < N - UNSEEN].mean(), rel=1e-12)
    assert last["unseen_client_loss_mean"] == pytest.approx(final[final.index >= N - UNSEEN].mean(), rel=1e-12)
    assert last["train_loss"] == pytest.approx(last["client_loss_mean"], rel=1e-12)  # F: the training clients'
    assert last["unseen_client_loss_finetune_mean"] < last["unseen_client_loss_mean"]  # fine-tuned on their data


def test_sampled_estimate_standard_error_is_calibrated(run_config):
    """The mean over eval.clients = S of N digits clients (Dirichlet(0.3)), drawn by 200 seeds, against the mean over
    all: z = (estimate - mean) / se has mean ~0 and std ~1 when se carries the finite-population factor
    sqrt(1 - S/N) (S = N/2: without it the std would be 0.71)."""
    n, s = 40, 20
    settings = run_config("dataset=digits", f"dataset.num_clients={n}", "partition=dirichlet", "partition.alpha=0.3",
                          "eval.per_client=true")
    problem = build_problem(settings, 8)
    w = problem.init_params(1, 0) + 0.05 * torch.randn(1, problem.dim, generator=torch.Generator().manual_seed(2))
    loss = problem.client_scores(w, np.arange(n)).loss[0]
    assert np.isfinite(loss).all()  # every client holds test samples
    z = []
    for seed in range(200):
        at = evaluated_clients(seed, n, s)
        cols = ClientScores(at, np.ones(s, dtype=np.int64), loss[None, at], np.full((1, s), np.nan), n).columns(0)
        z.append((cols["client_loss_mean"] - loss.mean()) / cols["client_loss_se"])
    assert abs(np.mean(z)) < 0.2 and 0.85 <= np.std(z) <= 1.15


def test_data_problem_objective_is_the_training_clients(run_config):
    """digits with a quarter of the clients unseen: the weights are the training clients' n_k / n_train (0 on the
    unseen), and train_loss the mean loss over their samples alone (float64 sums of float64 terms: 1e-12)."""
    settings = run_config("dataset=digits", "dataset.num_clients=12", "dataset.unseen_clients=0.25", "dtype=float64",
                          "algorithm.clients_per_round=4",
                          "eval.per_client=true")
    problem = build_problem(settings, 8)
    training = problem.training_clients
    assert training == 9 and problem.weights[training:].tolist() == [0.0] * 3
    assert problem.weights[:training] == pytest.approx(problem.sizes[:training] / problem.sizes[:training].sum())
    w = problem.init_params(2, 0) + 0.1 * torch.randn(2, problem.dim, dtype=torch.float64,
                                                      generator=torch.Generator().manual_seed(5))
    rows = torch.arange(int(problem.sizes[:training].sum()))
    with torch.no_grad():
        loss = problem.objective.loss_terms(w, problem.x[rows], problem.y[rows])[0] / len(rows)
    want = (loss + problem.objective.regularizer(w)).numpy()
    assert np.abs(problem.evaluate(w).train_loss - want).max() < 1e-12 * np.abs(want).max()
