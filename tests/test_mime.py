"""Mime and MimeLite (Karimireddy et al. 2020): the server's momentum held fixed in the local steps, every client's
full-batch gradient at the server model; with one local step and full participation Mime is centralized SGD with
momentum; the extra exchange is counted; rows are the same on shards, in a batch and resumed."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from fedharness.config.load import load_settings
from fedharness.core.executors import InlineExecutor
from fedharness.runs.batch import Slot
from fedharness.runs.execute import execute, execute_batch
from quadratic_runs import run_engine
from test_batched_slots import assert_same_rows, rounds_table
from test_same_bits import StopAt

QUADRATIC = ("dataset=quadratic", "dataset.num_clients=6", "dataset.dim=3", "dataset.curvature=random",
             "dataset.mu=0.5", "dataset.L=2.0", "dataset.spread=2.0", "dataset.noise=0.5", "algorithm.client_lr=0.05",
             "dtype=float64")
PARTIAL = ("algorithm.sampler=scheme_i", "algorithm.clients_per_round=3", "replicas=2")


@pytest.mark.parametrize("rounds", [1, 30])
def test_mime_with_one_local_step_is_centralized_sgd_with_momentum(run_config, rounds):
    beta, lr = 0.9, 0.05
    run = run_engine(run_config(*QUADRATIC, "algorithm=mime", f"algorithm.mime_momentum={beta}",
                                "algorithm.sampler=full", "algorithm.local_steps=1", "algorithm.server_lr=1",
                                f"rounds={rounds}"))
    # Centralized SGD with momentum on F = sum_k p_k F_k in the convention the paper's base algorithm has:
    # m_t = beta m_{t-1} + (1 - beta) grad F(x_t), x_{t+1} = x_t - lr m_t, m_{-1} = 0, x_0 = 0. The minibatch noise
    # cancels: Mime's step takes grad f_k(y; z) - grad f_k(x; z) + c with y = x and the same z.
    p, A, e = run.problem.weights, run.problem.A_np, run.problem.e_np
    x, m = np.zeros(3), np.zeros(3)
    for _ in range(rounds):
        m = beta * m + (1 - beta) * np.einsum("n,nde,ne->d", p, A, x - e)
        x = x - lr * m
    # each round's aggregate is an exact sum rounded to 2^-48 of max |x| (K = 6 terms, core/exact_sum.py) and the
    # gradients are float64 products in another order: 1e-12 leaves 30 rounds two orders of magnitude
    np.testing.assert_allclose(run.x[0], x, rtol=1e-12, atol=0)


class Recording(InlineExecutor):
    """Keeps each round's plan (its clients, coefficients and local steps)."""

    def __init__(self, problem, solver, num_shards: int = 1):
        super().__init__(problem, solver, num_shards)
        self.plans = []

    def local_updates(self, x, plan):
        if not plan.grads_only:
            self.plans.append(plan)
        return super().local_updates(x, plan)


@pytest.mark.parametrize("name,minibatch_grads,down_vectors", [("mimelite", 1, 2), ("mime", 2, 3)])
def test_bytes_and_grad_evals_count_the_full_batch_gradient(run_config, name, minibatch_grads, down_vectors):
    settings = run_config("dataset=synthetic", "dataset.num_clients=8", "dtype=float32", f"algorithm={name}",
                          "algorithm.sampler=scheme_i", "algorithm.clients_per_round=4", "algorithm.local_steps=3",
                          "algorithm.batch_size=5", "replicas=2", "rounds=4", "reference=off")
    run = run_engine(settings, executor_cls=Recording)
    sizes, dim = run.problem.sizes, run.problem.dim
    grad_evals, up, down = np.zeros(2), np.zeros(2), np.zeros(2)
    for plan in run.engine.executor.plans:
        for r in range(2):
            clients = np.unique(plan.clients[r][plan.coef[r] != 0])  # a client drawn twice trains once
            steps = sum(int(plan.tau[r][plan.clients[r] == k][0]) for k in clients)
            grad_evals[r] += minibatch_grads * steps * 5 + sizes[clients].sum()  # + one pass over its samples
            up[r] += len(clients) * 2 * dim * 4  # Delta_k and grad F_k(x), float32
            down[r] += len(clients) * down_vectors * dim * 4  # x and m (Mime: and c)
    counters = run.outcome.state.counters
    assert sizes.min() != sizes.max()  # the full-batch count is the clients' own sizes, not a constant
    assert counters["grad_evals"].tolist() == grad_evals.tolist()
    assert counters["bytes_up"].tolist() == up.tolist() and counters["bytes_down"].tolist() == down.tolist()


@pytest.mark.parametrize("name", ["mime", "mimelite"])
def test_rows_are_the_same_on_one_and_three_shards(run_config, name):
    args = (*QUADRATIC, f"algorithm={name}", *PARTIAL, "algorithm.local_steps=5", "rounds=20")
    one, three = run_engine(run_config(*args), num_shards=1), run_engine(run_config(*args), num_shards=3)
    assert np.array_equal(one.x, three.x)
    for key, value in one.outcome.state.server_ctx.items():
        assert np.array_equal(value, three.outcome.state.server_ctx[key])


def test_mime_removes_the_drift_fedavg_keeps(run_config):
    args = (*QUADRATIC, "dataset.noise=0", "algorithm.sampler=full", "algorithm.local_steps=5", "rounds=250")
    fedavg, mime = run_engine(run_config(*args)), run_engine(run_config(*args, "algorithm=mime"))
    w_star = mime.reference.w_star
    assert np.linalg.norm(fedavg.x - w_star) > 0.02  # FedAvg's fixed point: 0.031 away
    assert np.linalg.norm(mime.x - w_star) < 1e-6  # c swaps each client's drift for the full gradient's


# batch_size 24 (the default): at 8, even FedAvg's float32 rows differ between 1 and 3 shards (a kernel's sums
# depend on how many clients a batch holds there; found here, not Mime's)
SMALL = ("dataset.num_clients=12", "algorithm.clients_per_round=4", "algorithm.local_steps=3", "rounds=12", "eval_every=3", "reference=off", "progress=false")
COLUMNS = ("replica", "series", "round", "local_steps", "grad_evals", "bytes_up", "bytes_down", "train_loss",
           "grad_norm_sq", "test_loss", "test_acc")


def _rows(results, run_id: str) -> list[tuple]:
    table = pq.read_table(results / "rounds" / f"run_id={run_id}", columns=list(COLUMNS)).to_pylist()
    return sorted(tuple(r[c] for c in COLUMNS) for r in table)


def test_mime_resumed_and_in_a_batch_gives_the_rows_of_a_run_alone(tmp_path):
    def load(*extra: str):
        return load_settings([f"results_dir={tmp_path}", *SMALL, "algorithm=mime", "dtype=float64", *extra])

    assert execute(load(), run_id="alone").status == "ok"
    alone = _rows(tmp_path, "alone")
    cut = load("checkpoint_every=4")
    assert execute(cut, run_id="resumed", callbacks=[StopAt(6)]).status == "stopped"  # resumes at round 4
    assert execute(cut.replace(resume="resumed")).status == "ok"
    assert _rows(tmp_path, "resumed") == alone  # the same bits: m and c are checkpointed with the server context
    assert execute(load("algorithm.client_lr=0.02"), run_id="alone-b").status == "ok"
    execute_batch([Slot(load(), "batch-a"), Slot(load("algorithm.client_lr=0.02"), "batch-b")], batch_id="the-batch")
    for slot, solo in (("batch-a", "alone"), ("batch-b", "alone-b")):  # a batch's promise (tests/test_batched_slots)
        assert_same_rows(rounds_table(tmp_path, slot), rounds_table(tmp_path, solo), 1e-12)


@pytest.mark.slow  # Ray's start: CI
@pytest.mark.parametrize("name", ["mime", "mimelite"])
def test_rows_on_ray_shards_are_the_inline_rows(local_ray, tmp_path, name):
    def rows(run_id: str, *extra: str) -> list[tuple]:
        settings = load_settings([f"results_dir={tmp_path}", *SMALL, f"algorithm={name}", "threads=1", *extra])
        assert execute(settings, run_id=run_id).status == "ok"
        return _rows(tmp_path, run_id)

    # threads=1: the float32 kernels' sums then do not depend on how many clients a batch holds (test_same_bits)
    assert rows("ray", "executor=ray", "ray.num_shards=3") == rows("inline")
