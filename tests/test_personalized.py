"""pFedMe, Per-FedAvg and APFL against their closed forms on quadratic clients f_k(w) = 1/2 (w - e_k)^T A_k (w - e_k)
(A_k of different eigenvectors, eigenvalues in [0.5, 2]; unequal weights p_k; full participation; exact gradients;
float64). With P_k = I - (I - eta G_k)^tau, a method whose local step is w <- w - eta G_k (w - e_k) sends
Delta_k = -P_k (w - e_k), so the server's fixed point is w_tau(G) = (sum p_k P_k)^-1 sum p_k P_k e_k (any server_lr).
The runs start at w = 0 and contract to it geometrically; each test states its contraction and the rounds it runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedharness.assembly.build import algorithm_for
from fedharness.cli import main
from fedharness.contracts import client_columns
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.core.personal import FineTune
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.runs.batch import Slot
from fedharness.runs.execute import execute, execute_runs, prepare
from test_client_eval import bn_mlp  # noqa: F401  (the fixture: an MLP with BatchNorm, registered for a test)
from test_client_store import CrashAt

QUADRATIC = ("dataset=quadratic", "dataset.num_clients=6", "dataset.dim=3", "dataset.curvature=random",
             "dataset.mu=0.5", "dataset.L=2.0", "dataset.spread=2.0", "dtype=float64", "algorithm.sampler=full",
             "progress=false")
UNEQUAL_P = np.array([0.4, 0.05, 0.25, 0.1, 0.15, 0.05])
REL = 1e-8  # the bound; the contractions below leave < 1e-12 of the start's distance after the rounds run


def _run(run_config, rounds: int, *overrides: str):
    """The executor and outcome of `rounds` rounds on the quadratic with weights UNEQUAL_P, and the problem."""
    cfg = run_config(*QUADRATIC, *overrides)
    problem, _, _ = prepare(cfg)
    problem = QuadraticProblem(problem.A_np, problem.e_np, UNEQUAL_P, dtype=torch.float64)
    algorithm = algorithm_for(cfg, problem)
    executor = InlineExecutor(problem, algorithm.solver)
    engine = Engine(problem, algorithm, executor, rounds=rounds, seed=cfg.seed, replicas=1, eval_every=rounds,
                    reference=None)
    outcome = engine.run()
    assert outcome.status == "ok"
    return executor, outcome, problem


def fixed_point(A: np.ndarray, e: np.ndarray, p: np.ndarray, G: np.ndarray, eta: float, tau: int) -> np.ndarray:
    """w_tau(G) = (sum p_k P_k)^-1 sum p_k P_k e_k, P_k = I - (I - eta G_k)^tau."""
    eye = np.eye(A.shape[1])
    P = np.stack([eye - np.linalg.matrix_power(eye - eta * g, tau) for g in G])
    return np.linalg.solve(np.einsum("k,kij->ij", p, P), np.einsum("k,kij,kj->i", p, P, e))


def _rel(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.linalg.norm(x - y) / np.linalg.norm(y))


# pFedMe: lambda = 1, inner lr nu = 0.3, K = 40: C_k = I - nu (A_k + lambda I) has eigenvalues in
# [1 - 0.3 * 3, 1 - 0.3 * 1.5] = [0.1, 0.55], so ||C_k^K|| <= 0.55^40 = 4e-11 < 1e-10: the inner problem is solved.
# Its local step is then w <- w - eta lambda M_k (w - e_k), M_k = (A_k + lambda I)^-1 A_k (eigenvalues of
# lambda M_k in [1/3, 2/3]); at eta = 0.5 the server map's contraction is at most 1 - 0.5/3 per local step.
PFEDME = ("algorithm=pfedme", "algorithm.pfedme_lambda=1.0", "algorithm.pfedme_inner_lr=0.3",
          "algorithm.pfedme_inner_steps=40", "algorithm.client_lr=0.5")


def _pfedme_G(A: np.ndarray, lam: float) -> np.ndarray:
    eye = np.eye(A.shape[1])
    return np.stack([lam * np.linalg.solve(a + lam * eye, a) for a in A])


@pytest.mark.parametrize("R, beta, rounds", [(1, 1.0, 200), (1, 0.5, 400), (3, 1.0, 80)])
def test_pfedme_reaches_its_closed_form(run_config, R, beta, rounds):
    """R = 1: (sum p_k M_k)^-1 sum p_k M_k e_k for any beta; R = 3: w_3(lambda M_k). Contraction per round at least
    (1 - beta (1 - (5/6)^R)): after the rounds run, below 1e-12 of the start's distance (R = 1, beta = 0.5: 0.92^400)."""
    executor, outcome, problem = _run(run_config, rounds, *PFEDME, f"algorithm.local_steps={R}", f"algorithm.server_lr={beta}")
    A, e = problem.A_np, problem.e_np
    M = _pfedme_G(A, 1.0)
    if R == 1:
        want = np.linalg.solve(np.einsum("k,kij->ij", UNEQUAL_P, M), np.einsum("k,kij,kj->i", UNEQUAL_P, M, e))
    else:
        want = fixed_point(A, e, UNEQUAL_P, M, 0.5, R)
    x = outcome.state.x.numpy()[0]
    assert _rel(x, want) < REL
    # not FedAvg's point: the Moreau envelope moves it (measured below)
    assert _rel(want, fixed_point(A, e, UNEQUAL_P, A, 0.5, R)) > 1e-3


# Per-FedAvg: a = 0.2 < 1 / lambda_max(A_k) = 0.5; G_k = (I - a A_k) A_k (I - a A_k) (HF) or A_k (I - a A_k) (FO).
# On A_k's eigenvectors G_k has eigenvalues lambda (1 - a lambda)^2 in [0.32, 0.72] (HF) and lambda (1 - a lambda) in
# [0.45, 1.2] (FO; G_k is symmetric: A_k and I - a A_k commute); eta = 0.5 contracts each local step by at least
# 1 - 0.5 * 0.32 = 0.84.
@pytest.mark.parametrize("tau", [1, 4])
def test_perfedavg_fo_and_hf_reach_their_closed_forms(run_config, tau):
    a, eta, rounds = 0.2, 0.5, 200
    out = {}
    for variant in ("fo", "hf"):
        executor, outcome, problem = _run(run_config, rounds, f"algorithm=perfedavg_{variant}", f"algorithm.perfedavg_step={a}",
                               f"algorithm.client_lr={eta}", f"algorithm.local_steps={tau}")
        out[variant] = outcome.state.x.numpy()[0]
    A, e = problem.A_np, problem.e_np
    eye = np.eye(A.shape[1])
    fo = np.stack([k @ (eye - a * k) for k in A])
    hf = np.stack([(eye - a * k) @ k @ (eye - a * k) for k in A])
    want_fo, want_hf = fixed_point(A, e, UNEQUAL_P, fo, eta, tau), fixed_point(A, e, UNEQUAL_P, hf, eta, tau)
    assert _rel(out["fo"], want_fo) < REL
    assert _rel(out["hf"], want_hf) < REL
    assert _rel(want_hf, want_fo) > 1e-2  # the two variants' points differ (measured in the report)


# APFL, fixed alpha = 0.6, one local step of eta = 0.5 a round: w goes to w* = (sum p_k A_k)^-1 sum p_k A_k e_k
# (contraction 1 - eta lambda_min(sum p_k A_k) <= 0.75), v_k by v <- v - eta alpha A_k (alpha v + (1 - alpha) w - e_k),
# contraction 1 - eta alpha^2 lambda_min(A_k) <= 1 - 0.5 * 0.36 * 0.5 = 0.91; 0.91^400 = 4e-17.
def test_apfl_with_fixed_alpha_reaches_its_closed_form(run_config):
    alpha, eta = 0.6, 0.5
    executor, outcome, problem = _run(run_config, 400, "algorithm=apfl", f"algorithm.apfl_alpha={alpha}",
                                      f"algorithm.client_lr={eta}", "algorithm.local_steps=1")
    A, e = problem.A_np, problem.e_np
    w_star = np.linalg.solve(np.einsum("k,kij->ij", UNEQUAL_P, A), np.einsum("k,kij,kj->i", UNEQUAL_P, A, e))
    assert _rel(outcome.state.x.numpy()[0], w_star) < REL
    kept = executor.get_state()
    for k in range(len(e)):
        v, a = kept[(0, k)]["personal"][:-1].numpy(), float(kept[(0, k)]["personal"][-1])
        assert a == alpha  # fixed: the slot keeps the configured alpha
        assert _rel(v, (e[k] - (1 - alpha) * w_star) / alpha) < REL
        assert _rel(alpha * v + (1 - alpha) * w_star, e[k]) < REL


def test_apfl_adaptive_alpha_follows_the_papers_recurrence(run_config):
    """One round of E = 3 steps from w = v = 0 at alpha_0 = 0.5, replayed in numpy per client: alpha_k, v_k and the
    round's w to 1e-12 relative (float64, a few dozen operations each: rounding ~1e-15). alpha moves from its start
    (its first step's gradient <v - w, .> is 0 since v = w; the later ones are not): measured, four clients' alpha
    clipped at 0, two inside (0.24, 0.11)."""
    alpha0, eta, E = 0.5, 0.3, 3
    executor, outcome, problem = _run(run_config, 1, "algorithm=apfl", f"algorithm.apfl_alpha={alpha0}",
                                      "algorithm.apfl_adaptive=true", f"algorithm.client_lr={eta}",
                                      f"algorithm.local_steps={E}")
    A, e = problem.A_np, problem.e_np
    kept = executor.get_state()
    x = np.zeros(problem.dim)
    for k in range(len(e)):
        w, v, a = np.zeros(problem.dim), np.zeros(problem.dim), alpha0
        for _ in range(E):
            mixed = a * v + (1 - a) * w
            gv, gw = A[k] @ (mixed - e[k]), A[k] @ (w - e[k])
            a, v, w = min(max(a - eta * (v - w) @ gv, 0.0), 1.0), v - eta * a * gv, w - eta * gw
        x += UNEQUAL_P[k] * w
        got = kept[(0, k)]["personal"].numpy()
        assert abs(got[-1] - a) <= 1e-12 * abs(a) and abs(a - alpha0) > 1e-3
        assert _rel(got[:-1], v) < 1e-12
    assert _rel(outcome.state.x.numpy()[0], x) < 1e-12


def _personal_losses(executor: InlineExecutor, x: torch.Tensor, clients: np.ndarray, steps: int, lr: float):
    """Each client's loss f_k under eval.personal=personal, scored by `executor`'s shards from the global x [1, dim]."""
    spec = FineTune(steps, np.array([lr]), 0, np.array([0]), np.array([0]), clients, "personal")
    return executor.client_scores(x, np.array([0]), clients, spec).loss[0]


def _f(A: np.ndarray, e: np.ndarray, w: np.ndarray) -> np.ndarray:
    """f_k(w_k) of each client k for rows w [N, d]."""
    return 0.5 * np.einsum("kd,kde,ke->k", w - e, A, w - e)


FRESH_STEPS, FRESH_LR = 6, 0.3  # eval.finetune_steps and its step size for the clients without a kept model


def test_personal_models_at_evaluation_are_the_methods_closed_forms(run_config):
    """eval.personal=personal on the trained runs' executors (clients that keep a personal model) and on fresh ones
    of the same solver (none kept: an unseen client's case), against the closed forms: pFedMe's kept theta_k =
    (A_k + lambda I)^-1 (A_k e_k + lambda w) at R = 1, and for a fresh client FRESH_STEPS steps of size nu on its
    personal objective, theta* + C_k^6 (w - theta*); APFL's v_bar_k = e_k, fresh (I - lr alpha^2 A_k)^6 (w - e_k)
    + e_k; Per-FedAvg's one adaptation step w - a A_k (w - e_k) for every client (whatever eval.finetune_steps).
    The losses f_k to 1e-8 relative to f_k's scale at w (the kept models carry the runs' 1e-12 convergence error)."""
    cases = {"pfedme": (PFEDME + ("algorithm.local_steps=1",), 200), "perfedavg_hf": (
        ("algorithm=perfedavg_hf", "algorithm.perfedavg_step=0.2", "algorithm.client_lr=0.5",
         "algorithm.local_steps=1"), 100), "apfl": (
        ("algorithm=apfl", "algorithm.apfl_alpha=0.6", "algorithm.client_lr=0.5", "algorithm.local_steps=1"), 400)}
    for name, (overrides, rounds) in cases.items():
        executor, outcome, problem = _run(run_config, rounds, *overrides)
        A, e, x = problem.A_np, problem.e_np, outcome.state.x
        w = np.broadcast_to(x.numpy()[0], e.shape)
        clients = np.arange(len(e))
        scale = _f(A, e, w)
        eye = np.eye(problem.dim)
        kept = _personal_losses(executor, x, clients, FRESH_STEPS, FRESH_LR)
        fresh = _personal_losses(InlineExecutor(problem, executor.shards[0].solver, num_shards=3), x, clients,
                                 FRESH_STEPS, FRESH_LR)
        if name == "pfedme":
            theta = np.stack([np.linalg.solve(a + eye, a @ ek + w[0]) for a, ek in zip(A, e)])
            C = np.stack([np.linalg.matrix_power(eye - 0.3 * (a + eye), FRESH_STEPS) for a in A])
            want_kept, want_fresh = theta, theta + np.einsum("kde,ke->kd", C, w - theta)
        elif name == "apfl":
            D = np.stack([np.linalg.matrix_power(eye - FRESH_LR * 0.36 * a, FRESH_STEPS) for a in A])
            want_kept, want_fresh = e, e + np.einsum("kde,ke->kd", D, w - e)
        else:
            want_kept = want_fresh = w - 0.2 * np.einsum("kde,ke->kd", A, w - e)
        assert np.abs(kept - _f(A, e, want_kept)).max() < REL * scale.max(), name
        assert np.abs(fresh - _f(A, e, want_fresh)).max() < REL * scale.max(), name
        assert np.abs(fresh - scale).min() > 1e-3 * scale.max(), name  # personalized: not the global model's f_k


# --- pFedMe: the same bits wherever its clients train ----------------------------------------------------------

# digits with minibatches (the inner steps' gradients are the step's minibatch), partial participation, unseen
# clients, and eval.personal=personal: kept personal models, fresh ones (not yet sampled) and unseen clients' scored
PFEDME_DIGITS = ["dataset=digits", "dataset.num_clients=10", "dataset.data_seed=0", "partition=dirichlet",
                 "partition.alpha=0.5", "dataset.unseen_clients=0.2", "algorithm=pfedme", "algorithm.batch_size=8",
                 "algorithm.local_steps=2", "algorithm.pfedme_inner_steps=3", "algorithm.pfedme_lambda=1.0",
                 "algorithm.client_lr=0.05", "algorithm.clients_per_round=3", "rounds=4", "eval_every=1",
                 "replicas=2", "heterogeneity=false", "reference=off", "threads=1", "dtype=float64",
                 "eval.personal=[global,personal]", "eval.finetune_steps=2"]
PERSONAL = tuple(c for c in (*client_columns("personal"), *client_columns("personal", unseen=True))
                 if not c.endswith("_se"))  # se: null where every client is scored


def _table(rows: list[dict]) -> np.ndarray:
    frame = pd.DataFrame(rows).sort_values(["round", "replica", "series"])
    return frame[["round", "replica", "train_loss", "test_acc", *PERSONAL]].to_numpy(float)


def test_pfedme_same_bits_on_3_shards_in_a_batch_of_seeds_and_resumed(run_config, tmp_path):
    want = _table(execute(run_config(*PFEDME_DIGITS)).rows)
    assert np.isfinite(want[-2:, 4:]).all()  # scored at the last round: the clients' personal models, the unseen too
    assert np.array_equal(_table(execute(run_config(*PFEDME_DIGITS, "num_shards=3")).rows), want, equal_nan=True)
    batch = execute_runs([Slot(run_config(*PFEDME_DIGITS)), Slot(run_config(*PFEDME_DIGITS, "seed=7"))])
    assert np.array_equal(_table(batch[0].rows), want, equal_nan=True)
    alone = _table(execute(run_config(*PFEDME_DIGITS, "seed=7")).rows)
    assert np.array_equal(_table(batch[1].rows), alone, equal_nan=True)
    cut = [*PFEDME_DIGITS, f"results_dir={tmp_path / 'cut'}", "checkpoint_every=2"]
    with pytest.raises(RuntimeError, match="crashed at round 3"):
        execute(run_config(*cut), run_id="victim", callbacks=[CrashAt(3)])
    execute(run_config(*cut, "resume=victim", "num_shards=3"))  # the personal slots from the checkpoint's files
    got = pd.read_parquet(tmp_path / "cut" / "rounds")
    assert np.array_equal(_table(got[got["series"] == "iterate"].to_dict("records")), want, equal_nan=True)


@pytest.mark.slow
def test_pfedme_same_bits_on_ray(local_ray, run_config):
    want = _table(execute(run_config(*PFEDME_DIGITS)).rows)
    ray = execute(run_config(*PFEDME_DIGITS, "executor=ray", "ray.num_shards=2", "checkpoint_every=2"))
    assert np.array_equal(_table(ray.rows), want, equal_nan=True)


@pytest.mark.parametrize("override, message", [
    ("algorithm=apfl algorithm.apfl_alpha=1.5", "invalid value for 'algorithm.apfl_alpha': 1.5 (a finite number in "
     "[0, 1])"),
    ("algorithm=apfl algorithm.apfl_alpha=-0.1", "invalid value for 'algorithm.apfl_alpha': -0.1 (a finite number in "
     "[0, 1])"),
    ("algorithm=perfedavg_hf algorithm.perfedavg_step=0", "invalid value for 'algorithm.perfedavg_step': 0 (a finite "
     "number > 0)"),
    ("algorithm=perfedavg_fo algorithm.perfedavg_step=-0.01", "invalid value for 'algorithm.perfedavg_step': -0.01 (a "
     "finite number > 0)"),
    ("algorithm=pfedme algorithm.pfedme_inner_steps=0", "invalid value for 'algorithm.pfedme_inner_steps': 0 (an "
     "integer >= 1)"),
    ("algorithm=pfedme algorithm.momentum=0.9", "invalid value for 'algorithm.momentum': 0.9 (0 with "
     "algorithm.solver=pfedme (its local step is its paper's; the models are averaged))"),
    ("algorithm=apfl model=bn_mlp", "invalid value for 'algorithm.solver': 'apfl' (a solver other than apfl with "
     "model=bn_mlp: its buffers (BatchNorm statistics) would need a personal copy of their own)"),
    ("algorithm=apfl algorithm.aggregator=median", "invalid value for 'algorithm.aggregator': 'median' (fedavg with "
     "algorithm.solver=apfl (its local step is its paper's; the models are averaged))"),
])
def test_bad_input_exits_2_in_one_line_writing_nothing(tmp_path, capsys, override, message, bn_mlp):
    results = tmp_path / "results"
    data = ["dataset=digits"] if "bn_mlp" in override else ["dataset=quadratic"]
    assert main(["run", f"results_dir={results}", *data, "rounds=2", "progress=false", *override.split()]) == 2
    err = capsys.readouterr().err
    assert err == f"fedharness: error: {message}\n"
    assert not results.exists()
