"""Personal models on the client store (algorithms/personal.py, core/personal.py): Ditto against its closed form on
quadratic clients; FedBABU's head untouched by training and moved by fine-tuning; FedRep's heads kept per client
and never sent; the personal columns the same on 1 and 3 shards, in a batch of seeds, resumed and on Ray; bad
input and the combinations not yet supported refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import fedharness
from fedharness.assembly.build import algorithm_for
from fedharness.cli import main
from fedharness.contracts import client_columns
from fedharness.core.engine import Engine
from fedharness.core.executors import InlineExecutor
from fedharness.core.personal import FineTune, personal_models
from fedharness.problems.quadratic import QuadraticProblem
from fedharness.runs.batch import Slot
from fedharness.runs.execute import execute, execute_runs, personal_of, prepare
from test_client_eval import bn_mlp  # noqa: F401  (the fixture: an MLP with BatchNorm, registered for a test)
from test_personal_eval import CrashAt, _frame

# Eigenvalues of A_k in [0.5, 2] with random eigenvectors (curvature=random), unequal client weights p_k
QUADRATIC = ("dataset=quadratic", "dataset.num_clients=5", "dataset.dim=3", "dataset.curvature=random",
             "dataset.mu=0.5", "dataset.L=2.0", "dataset.spread=2.0", "dtype=float64", "algorithm=ditto",
             "algorithm.sampler=full", "algorithm.client_lr=0.3", "algorithm.ditto_lambda=0.5", "reference=off",
             "progress=false")
WEIGHTS = np.array([0.35, 0.1, 0.25, 0.2, 0.1])


@pytest.fixture(autouse=True)
def one_thread():
    """Engines built here run outside `execute`, which sets threads=1: small batched products only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _engine(cfg, problem, rounds: int, num_shards: int = 1, **options) -> Engine:
    algorithm = algorithm_for(cfg, problem)
    return Engine(problem, algorithm, InlineExecutor(problem, algorithm.solver, num_shards), rounds=rounds,
                  seed=cfg.seed, replicas=cfg.replicas, eval_every=rounds, **options)


@pytest.mark.parametrize("steps, rounds", [(1, 300), (4, 120)])
def test_ditto_reaches_its_closed_form(run_config, steps, rounds):
    """Full participation, full-batch gradients, E steps of size eta: FedAvg's fixed point is
    w_E = (sum p_k P_k)^-1 sum p_k P_k e_k, P_k = I - (I - eta A_k)^E (w_1 = w*), and each personal model the
    minimizer of f_k(v) + lambda/2 ||v - w_E||^2, (A_k + lambda I)^-1 (A_k e_k + lambda w_E). The rounds contract
    the global error by at most 1 - eta min eig(sum p_k P_k) <= 0.85 (E = 1) a round and each personal model's by
    max |1 - eta (a + lambda)|^E <= 0.7^E: 300 and 120 rounds leave < 1e-20 of the start, so what is left is
    float64 rounding of the fixed point's recursion (~1e-15 relative); 1e-8 relative is far above it."""
    cfg = run_config(*QUADRATIC, f"algorithm.local_steps={steps}")
    base = prepare(cfg)[0]
    problem = QuadraticProblem(base.A_np, base.e_np, WEIGHTS, dtype=torch.float64)
    engine = _engine(cfg, problem, rounds, num_shards=2)
    x = engine.run().state.x.numpy()[0]
    eta, lam, d = 0.3, 0.5, problem.dim
    P = np.stack([np.eye(d) - np.linalg.matrix_power(np.eye(d) - eta * a, steps) for a in problem.A_np])
    w_E = np.linalg.solve(np.einsum("k,kde->de", WEIGHTS, P), np.einsum("k,kde,ke->d", WEIGHTS, P, problem.e_np))
    if steps == 1:  # E = 1: the exact optimum
        assert np.abs(w_E - problem.optimum()).max() < 1e-12 * np.abs(w_E).max()
    assert np.abs(x - w_E).max() < 1e-8 * np.abs(w_E).max()
    kept = engine.executor.get_state()
    assert sorted(kept) == [(0, k) for k in range(5)]
    for (_, k), slots in kept.items():
        a, e = problem.A_np[k], problem.e_np[k]
        want = np.linalg.solve(a + lam * np.eye(d), a @ e + lam * w_E)
        assert np.abs(slots["personal"].numpy() - want).max() < 1e-8 * np.abs(want).max()
    if steps > 1:  # the personal models are not the global model, nor the clients' own optima
        assert min(np.abs(s["personal"].numpy() - w_E).max() for s in kept.values()) > 1e-2


def test_ditto_personal_columns_score_the_kept_models(run_config):
    """eval.personal=personal scores each client with its kept v_k: the mean of f_k(v_k) over the clients (float64,
    the same quadratic forms: 1e-12 relative covers their rounding)."""
    cfg = run_config(*QUADRATIC, "algorithm.local_steps=2", "rounds=6", "eval_every=6",
                     "eval.personal=[global,personal]")
    problem = prepare(cfg)[0]
    engine = _engine(cfg, problem, 6, client_eval=np.arange(5), personal=personal_of(cfg))
    row = engine.run().rows[-1]
    kept = engine.executor.get_state()
    v = np.stack([kept[(0, k)]["personal"].numpy() for k in range(5)])
    f = 0.5 * np.einsum("kd,kde,ke->k", v - problem.e_np, problem.A_np, v - problem.e_np)
    assert abs(row["client_loss_personal_mean"] - f.mean()) < 1e-12 * f.mean()
    assert row["client_loss_personal_mean"] < row["client_loss_mean"]  # better than the global model on each f_k


DIGITS = ["dataset=digits", "dataset.num_clients=8", "dataset.data_seed=0", "partition=dirichlet",
          "partition.alpha=0.5", "model=2nn", "algorithm.batch_size=8", "algorithm.local_steps=3",
          "algorithm.sampler=scheme_ii", "algorithm.clients_per_round=3", "rounds=4", "eval_every=2", "replicas=2",
          "heterogeneity=false", "reference=off", "threads=1", "dtype=float64", "eval.personal=[global,personal]",
          "eval.finetune_steps=3", "eval.finetune_every=2", "dataset.unseen_clients=0.25", "progress=false"]
OWN = [*client_columns("personal"), *client_columns("personal", unseen=True)]


def test_fedbabu_keeps_the_head_at_its_initialization_and_fine_tunes_it(run_config):
    cfg = run_config(*DIGITS, "algorithm=fedbabu", "replicas=1")
    problem = prepare(cfg)[0]
    lo, hi = problem.objective.head
    assert (lo, hi) == (problem.dim - 10 * 201, problem.dim)  # the 2NN's fc3: 200 inputs and a bias, 10 classes
    engine = _engine(cfg, problem, 4)
    x0 = engine.initial_state().x.clone()
    x = engine.run().state.x
    assert torch.equal(x[:, lo:hi], x0[:, lo:hi])  # bit for bit
    assert (x[:, :lo] - x0[:, :lo]).norm() > 1e-3 * x0[:, :lo].norm()  # the body trained
    clients = np.arange(problem.num_clients)
    spec = FineTune(3, np.array([0.05]), 4, np.array([cfg.seed]), np.array([0]), clients, "personal")
    tuned = personal_models(problem, engine.executor.shards[0].solver, x.expand(len(clients), -1).clone(),
                            [None] * len(clients), clients, spec, 0, chunk=8)
    assert torch.equal(tuned[:, :lo], x[:, :lo].expand(len(clients), -1))  # the body fixed
    assert (tuned[:, lo:hi] - x0[:, lo:hi]).abs().amax(1).min() > 0  # every client's head moved


def test_fedrep_keeps_each_clients_head_and_sends_only_the_body(run_config):
    cfg = run_config(*DIGITS, "algorithm=fedrep", "replicas=1")
    problem = prepare(cfg)[0]
    lo, hi = problem.objective.head
    engine = _engine(cfg, problem, 4)
    x0 = engine.initial_state().x.clone()
    outcome = engine.run()
    assert torch.equal(outcome.state.x[:, lo:hi], x0[:, lo:hi])  # the server's head: never updated
    kept = engine.executor.get_state()
    heads = torch.stack([slots["personal_head"] for slots in kept.values()])
    assert heads.shape[1] == hi - lo and len(kept) >= 3
    assert (heads - x0[0, lo:hi]).abs().amax(1).min() > 0  # each trained client's own head moved
    fedavg = execute(run_config(*DIGITS, "replicas=1", "eval.personal=global")).rows[-1]
    body = (problem.dim - (hi - lo)) / problem.dim  # bytes: the body's share of the model's
    assert outcome.rows[-1]["bytes_up"] == pytest.approx(fedavg["bytes_up"] * body, rel=1e-12)


def _own(rows) -> np.ndarray:
    return _frame(rows)[["round", "replica", "bytes_up", *OWN]].to_numpy(float)


@pytest.mark.parametrize("algorithm", ["ditto", pytest.param("fedrep", marks=pytest.mark.slow)])
def test_personal_columns_same_on_3_shards_chunked_in_a_batch_and_resumed(run_config, tmp_path, algorithm):
    """The personal columns and bytes, bit for bit (train_loss is not among them: the pooled evaluation's own
    chunks follow the memory budget)."""
    run = [*DIGITS, f"algorithm={algorithm}"]
    want = _own(execute(run_config(*run)).rows)
    assert np.isfinite(want[:, 3]).sum() == 6  # rounds 0, 2 and 4 of 2 replicas
    assert np.array_equal(_own(execute(run_config(*run, "num_shards=3")).rows), want, equal_nan=True)
    chunked = run_config(*run, "memory_budget_gb=0.012")  # a few copies a batched step
    assert np.array_equal(_own(execute(chunked).rows), want, equal_nan=True)
    batch = execute_runs([Slot(run_config(*run)), Slot(run_config(*run, "seed=7"))])
    assert np.array_equal(_own(batch[0].rows), want, equal_nan=True)
    assert np.array_equal(_own(batch[1].rows), _own(execute(run_config(*run, "seed=7")).rows), equal_nan=True)
    cut = [*run, f"results_dir={tmp_path / 'cut'}", "checkpoint_every=2"]
    with pytest.raises(RuntimeError, match="crashed at round 3"):
        execute(run_config(*cut), run_id="victim", callbacks=[CrashAt(3)])
    execute(run_config(*cut, "resume=victim", "num_shards=3"))
    got = pd.read_parquet(tmp_path / "cut" / "rounds")
    got = got[got["series"] == "iterate"].sort_values(["round", "replica"])
    assert np.array_equal(got[["round", "replica", "bytes_up", *OWN]].to_numpy(float), want, equal_nan=True)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["ditto", "fedrep"])
def test_personal_columns_on_two_ray_shards_equal_inline(local_ray, run_config, algorithm):
    run = [*DIGITS, f"algorithm={algorithm}", "checkpoint_every=2"]
    want = _own(execute(run_config(*run)).rows)
    assert np.array_equal(_own(execute(run_config(*run, "executor=ray", "ray.num_shards=2")).rows), want,
                          equal_nan=True)


class HeadedMLP(nn.Module):
    def __init__(self, in_shape, num_classes):
        super().__init__()
        self.body = nn.Linear(int(np.prod(in_shape)), 16)
        self.out = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.out(torch.relu(self.body(x.flatten(1))))


@pytest.fixture
def headed_mlp(bn_mlp):  # noqa: F811  (bn_mlp's fixture restores the registries after the test)
    fedharness.register_model("headed_mlp", HeadedMLP, head="out")
    return "headed_mlp"


def test_a_users_model_names_its_head(run_config, headed_mlp):
    problem = prepare(run_config(*DIGITS, f"model={headed_mlp}", "algorithm=fedrep"))[0]
    assert problem.objective.head == (problem.dim - 17 * 10, problem.dim)  # out: 16 inputs and a bias, 10 classes


REFUSED = [
    (["algorithm=ditto", "algorithm.ditto_lambda=-0.5"],
     "invalid value for 'algorithm.ditto_lambda': -0.5 (a finite number >= 0)"),
    (["algorithm=fedrep", "model=headed_mlp", "model.head=nope"],
     "invalid value for 'model.head': 'nope' (a module of the model with parameters: body, out)"),
    (["algorithm=ditto", "model=bn_mlp"], "invalid value for 'algorithm.solver': 'ditto' (a solver other than ditto "
     "with model=bn_mlp: its buffers (BatchNorm statistics) would need a personal copy of their own)"),
    (["algorithm=ditto", "dp.noise_multiplier=1.0"], "invalid value for 'dp.noise_multiplier': 1.0 (null with "
     "algorithm.solver=ditto (its personal models are not privatized))"),
    (["algorithm=fedrep", "attack=label_flip", "attack.fraction=0.25"], "invalid value for 'attack': 'label_flip' "
     "(none with algorithm.solver=fedrep (not yet combined with personal models))"),
    (["algorithm=fedbabu", "compress=topk", "stages=[compress]"], "invalid value for 'compress': 'topk' (none with "
     "algorithm.solver=fedbabu (not yet combined with personal models))"),
    (["algorithm=ditto", "systems.deadline_s=2"], "invalid value for 'systems.deadline_s': 2 (null with "
     "algorithm.solver=ditto (a cut-off client's personal model would be half-trained))"),
    (["algorithm=fedrep", "systems.mode=fedbuff"], "invalid value for 'systems.mode': 'fedbuff' (sync with "
     "algorithm.solver=fedrep (its clients train from the round's global model))"),
    (["algorithm=fedavg"], "invalid value for 'eval.personal': ['global', 'personal'] (global and/or finetune: "
     "algorithm.solver=sgd keeps no personal model (the personal protocol needs one that does: ditto, fedrep, "
     "fedbabu, pfedme, perfedavg_fo, perfedavg_hf, apfl))"),
]


HEADLESS = ([*QUADRATIC, "algorithm=fedbabu"], "invalid value for 'algorithm.solver': 'fedbabu' (a solver that needs "
            "no head: the data set's own objective declares none (built-in nets name their last layer; a user's "
            "model names it in model.head))")


@pytest.mark.parametrize("overrides, message", [*((DIGITS + o, m) for o, m in REFUSED), HEADLESS])
def test_bad_input_exits_2_in_one_line_writing_nothing(tmp_path, capsys, headed_mlp, overrides, message):
    results = tmp_path / "r"
    assert main(["run", *overrides, f"results_dir={results}"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fedharness: error: {message}"]
    assert not results.exists()


# --- FedRep on the linear-representation problem (Collins et al. 2021, Section 5.1 and Figure 2) -----------------

D, K, N, M, SIGMA = 20, 2, 100, 10, 1e-3  # dimension, rank, clients, samples a client, label noise


class LinearRepresentation(QuadraticProblem):
    """y = w_i*^T B*^T x + sigma z on client i's m samples, x ~ N(0, I_d); the model y^ = h^T B^T x with body B
    [d, k] (the flat vector's first d k entries) and head h [k] (the last k); loss 1/(2m) ||X_i B h - y_i||^2,
    full-batch gradients. A quadratic problem's bookkeeping (weights 1/N, one sample a client) with this loss."""

    def __init__(self, X: np.ndarray, y: np.ndarray, start: np.ndarray):
        dim = D * K + K
        super().__init__(np.repeat(np.eye(dim)[None], N, 0), np.zeros((N, dim)), dtype=torch.float64)
        self.X, self.y, self.start = torch.as_tensor(X), torch.as_tensor(y), torch.as_tensor(start)
        self.objective = SimpleNamespace(name="linear_representation", head=(D * K, dim), buffer_dim=0)

    def init_params(self, replicas: int, seed: int) -> torch.Tensor:
        return self.start.expand(replicas, -1).clone()

    def grad(self, w: torch.Tensor, batches, step: int) -> torch.Tensor:
        clients = torch.as_tensor(batches[:len(w)])
        B, h = w[:, :D * K].reshape(-1, D, K), w[:, D * K:]
        X = self.X[clients]
        r = torch.einsum("cmd,cdk,ck->cm", X, B, h) - self.y[clients]
        return torch.cat([torch.einsum("cmd,cm,ck->cdk", X, r, h).reshape(len(w), -1) / M,
                          torch.einsum("cdk,cmd,cm->ck", B, X, r) / M], 1)


def test_fedrep_learns_the_shared_representation(run_config):
    """Collins et al.'s linear-representation setting (d = 20, k = 2, N = 100 clients of m = 10 samples, noise
    sigma = 1e-3, B* a random orthonormal [d, k], w_i* ~ N(0, I_k)), B initialized by the method of moments as in
    their Algorithm 1 (the top-k eigenvectors of (1/Nm) sum y^2 x x^T) and h at 0; full participation, step 0.1.
    FedRep (10 head steps on the fixed body, then 1 body step: share 0.91 of 11) brings the principal-angle
    distance ||B_perp^T B*||_2 of its orthonormalized body from 0.54 to below 0.05 in 100 rounds (measured
    0.0029); FedAvg training body and head jointly on the global objective (one local step: a single head h for
    every client, so B moves along h alone) stays above 0.3 (measured 0.50). FedAvg with FedRep's 11 local steps
    does learn it here (measured 0.028 at 100 rounds): the local heads drift apart within a round."""
    rng = np.random.default_rng(0)
    b_star = np.linalg.qr(rng.normal(size=(D, K)))[0]
    X = rng.normal(size=(N, M, D))
    y = np.einsum("nmd,dk,nk->nm", X, b_star, rng.normal(size=(N, K))) + SIGMA * rng.normal(size=(N, M))
    moments = np.einsum("nm,nmd,nme->de", y ** 2, X, X) / (N * M)
    start = np.concatenate([np.linalg.eigh(moments)[1][:, -K:].reshape(-1), np.zeros(K)])
    problem = LinearRepresentation(X, y, start)

    def distance(w: np.ndarray) -> float:
        q = np.linalg.qr(w[:D * K].reshape(D, K))[0]
        return float(np.linalg.norm(b_star - q @ (q.T @ b_star), 2))

    def trained(*overrides: str) -> np.ndarray:
        cfg = run_config("dataset=quadratic", f"dataset.num_clients={N}", f"dataset.dim={D * K + K}", "dtype=float64",
                         "algorithm.sampler=full", "algorithm.client_lr=0.1", "reference=off", *overrides)
        return _engine(cfg, problem, 100).run().state.x.numpy()[0]

    assert 0.5 < distance(start) < 0.6  # measured 0.54
    assert distance(trained("algorithm=fedrep", "algorithm.local_steps=11", "algorithm.fedrep_head_share=0.91")) < 0.05
    assert distance(trained("algorithm=fedavg", "algorithm.local_steps=1")) > 0.3
