"""eval.personal (core/personal.py): the finetune protocol against its closed form on quadratic clients, each
client's f_k as its per-client loss, the training columns untouched by fine-tuning, the same fine-tuned columns on
1 and 3 shards, in a batch and resumed; the refusals of eval.personal's keys and dataset.unseen_clients."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedharness.cli import main
from fedharness.contracts import Callback, client_columns
from fedharness.core.executors import InlineExecutor
from fedharness.core.personal import FineTune, finetuned
from fedharness.problems import build_problem
from fedharness.runs.batch import Slot
from fedharness.runs.execute import execute, execute_runs, prepare_run
from test_client_eval import bn_mlp  # noqa: F401  (the fixture: an MLP with BatchNorm, registered for a test)

QUADRATIC = ["dataset=quadratic", "dataset.num_clients=9", "dataset.dim=5", "dataset.curvature=random",
             "dataset.mu=0.5", "dataset.L=3", "dtype=float64", "reference=off", "heterogeneity=false"]
DIGITS = ["dataset=digits", "dataset.num_clients=8", "dataset.data_seed=0", "partition=dirichlet", "partition.alpha=0.5",
          "algorithm.batch_size=8", "algorithm.local_steps=2", "algorithm.sampler=scheme_ii",
          "algorithm.clients_per_round=3", "rounds=4", "eval_every=2", "replicas=2", "heterogeneity=false",
          "reference=off", "threads=1", "dtype=float64", "eval.personal=[global,finetune]", "eval.finetune_steps=4",
          "eval.finetune_every=2"]
TUNED = client_columns("finetune")


def test_finetune_is_the_closed_form_on_quadratic_clients(run_config):
    """E full-batch steps of size lr on f_k = 1/2 (w - e_k)^T A_k (w - e_k) from x: (I - lr A_k)^E (x - e_k) + e_k.
    In float64 each step rounds at ~d eps relative, E = 6 steps of a contraction (lr L = 0.9 < 1): the iterate is
    within ~E d eps = 7e-15 of the closed form relative, and f_k there within twice that; 1e-12 is far above."""
    settings = run_config(*QUADRATIC)
    problem = build_problem(settings, 8)
    steps, lr = 6, 0.3
    x = torch.as_tensor(np.random.default_rng(4).normal(0, 2, (2, problem.dim)))
    clients = np.arange(problem.num_clients)
    rows, copies = np.repeat([0, 1], len(clients)), np.tile(clients, 2)
    spec = FineTune(steps, np.full(2, lr), 3, np.array([5, 5]), np.array([0, 1]), clients)
    got = torch.cat([finetuned(problem, x[j].expand(len(clients), -1).clone(), clients, spec, j, chunk=4)
                     for j in (0, 1)]).numpy()
    A, e = problem.A_np[copies], problem.e_np[copies]
    power = np.stack([np.linalg.matrix_power(np.eye(problem.dim) - lr * a, steps) for a in A])
    want = np.einsum("mde,me->md", power, x.numpy()[rows] - e) + e
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-12
    f_want = 0.5 * np.einsum("md,mde,me->m", want - e, A, want - e)
    executor = InlineExecutor(problem, prepare_run(settings).algorithm.solver, num_shards=3)
    scores = executor.client_scores(x, np.array([0, 1]), clients, spec)
    assert np.abs(scores.loss.reshape(-1) - f_want).max() / f_want.max() < 1e-12
    assert scores.n.tolist() == [1] * len(clients) and np.isnan(scores.acc).all()  # no accuracy on a quadratic


def test_quadratic_reports_every_clients_f_k(run_config):
    """dataset=quadratic's per-client loss is f_k(x) (float64 from the float64 A_k, e_k: 1e-12 covers the
    rounding of one quadratic form); the global columns summarize them; accuracy columns are null."""
    settings = run_config(*QUADRATIC, "eval.per_client=true", "rounds=2")
    problem = build_problem(settings, 8)
    x = torch.as_tensor(np.random.default_rng(1).normal(0, 1, (3, problem.dim)))
    got = problem.client_scores(x, np.arange(problem.num_clients)).loss
    diff = x.numpy()[:, None, :] - problem.e_np[None]
    want = 0.5 * np.einsum("rnd,nde,rne->rn", diff, problem.A_np, diff)
    assert np.abs(got - want).max() / want.max() < 1e-12
    last = execute(settings).rows[-1]
    assert last["client_acc_mean"] is None and last["client_loss_p50"] is not None
    assert last["client_loss_se"] is None  # every client evaluated: the mean is exact


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows).sort_values(["round", "replica", "series"]).reset_index(drop=True)


def test_finetune_leaves_training_columns_alone_and_runs_at_its_rounds(run_config, tmp_path):
    with_ft = _frame(execute(run_config(*DIGITS)).rows)
    without = _frame(execute(run_config(*DIGITS[:-3], "eval.per_client=true")).rows)
    same = [c for c in without.columns if c != "wall_s" and c not in TUNED]
    assert with_ft[same].equals(without[same])  # every training and global column, bit for bit
    tuned = with_ft[with_ft["client_acc_finetune_mean"].notna()]
    assert sorted(set(tuned["round"])) == [0, 2, 4] and len(tuned) == 3 * 2  # multiples of finetune_every
    assert not set(TUNED) & set(without.columns)
    last = run_config(*DIGITS[:-1])  # finetune_every null: the last evaluation only
    rounds = _frame(execute(last).rows).dropna(subset=["client_acc_finetune_mean"])["round"]
    assert set(rounds) == {4}
    final = with_ft[with_ft["round"] == 4]  # fine-tuning on a client's own data raises its accuracy here
    assert (final["client_acc_finetune_mean"] > final["client_acc_mean"]).all()


class CrashAt(Callback):
    def __init__(self, rnd: int):
        self.rnd = rnd

    def on_round_end(self, context) -> None:
        if context.round == self.rnd:
            raise RuntimeError(f"crashed at round {self.rnd}")


def test_finetuned_columns_same_on_3_shards_in_a_batch_and_resumed(run_config, tmp_path):
    def tuned(rows) -> np.ndarray:
        return _frame(rows)[["round", "replica", *TUNED]].to_numpy(float)

    run = DIGITS
    want = tuned(execute(run_config(*run)).rows)
    assert np.isfinite(want[:, 2]).sum() == 6
    assert np.array_equal(tuned(execute(run_config(*run, "num_shards=3")).rows), want, equal_nan=True)
    batch = execute_runs([Slot(run_config(*run)), Slot(run_config(*run, "seed=7"))])
    assert np.array_equal(tuned(batch[0].rows), want, equal_nan=True)
    assert np.array_equal(tuned(batch[1].rows), tuned(execute(run_config(*run, "seed=7")).rows), equal_nan=True)
    cut = [*run, f"results_dir={tmp_path / 'cut'}", "checkpoint_every=2"]
    with pytest.raises(RuntimeError, match="crashed at round 3"):
        execute(run_config(*cut), run_id="victim", callbacks=[CrashAt(3)])
    execute(run_config(*cut, "resume=victim"))
    got = pd.read_parquet(tmp_path / "cut" / "rounds")
    got = got[got["series"] == "iterate"].sort_values(["round", "replica"])
    assert np.array_equal(got[["round", "replica", *TUNED]].to_numpy(float), want, equal_nan=True)


@pytest.mark.parametrize("override, message", [
    ("eval.finetune_steps=-1", "invalid value for 'eval.finetune_steps': -1 (an integer >= 0)"),
    ("eval.personal=[global,personal]", "invalid value for 'eval.personal': ['global', 'personal'] (global and/or "
     "finetune: algorithm.solver=sgd keeps no personal model (the personal protocol needs one that does: ditto, "
     "fedrep, fedbabu, pfedme, perfedavg_fo, perfedavg_hf, apfl))"),
    ("eval.personal=[mine]", "invalid value for 'eval.personal': ['mine'] (one of global, finetune, personal, or a "
     "list of distinct ones)"),
    ("dataset.unseen_clients=1", "invalid value for 'dataset.unseen_clients': 1 (a finite number in [0, 1))"),
    ("dataset.unseen_clients=-0.1", "invalid value for 'dataset.unseen_clients': -0.1 (a finite number in [0, 1))"),
    ("dataset.unseen_clients=0.8", "invalid value for 'dataset.unseen_clients': 0.8 (a share that leaves at least "
     "algorithm.clients_per_round = 3 of the 8 clients to train (this one leaves 2))"),
])
def test_bad_personal_settings_exit_2_writing_nothing(tmp_path, capsys, override, message):
    results = tmp_path / "r"
    assert main(["run", *DIGITS, override, f"results_dir={results}", "progress=false"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"fedharness: error: {message}"]
    assert not results.exists()


@pytest.mark.slow
def test_finetuned_columns_on_two_ray_shards_equal_inline(local_ray, run_config):
    def tuned(rows) -> np.ndarray:
        return _frame(rows)[["round", "replica", *TUNED]].to_numpy(float)

    want = tuned(execute(run_config(*DIGITS)).rows)
    got = tuned(execute(run_config(*DIGITS, "executor=ray", "ray.num_shards=2")).rows)
    assert np.array_equal(got, want, equal_nan=True)


def test_fedbn_clients_fine_tune_from_their_own_buffers(run_config, bn_mlp):
    """model.buffers=local: with 0 fine-tuning steps each copy is the global parameters with the client's own
    buffers, which is what the global protocol scores (the buffer sets batched under vmap there, a copy at a time
    here: float64 sums of the same per-sample terms in other groupings, ~1e-16 relative; 1e-12 bounds it). After
    round 0 the clients that trained hold buffers of their own, so the server's would score differently."""
    run = [*DIGITS, f"model={bn_mlp}", "model.buffers=local", "eval.finetune_steps=0"]
    rows = _frame(execute(run_config(*run)).rows)
    tuned = rows.dropna(subset=["client_loss_finetune_mean"])
    assert len(tuned) == 6
    for stat in ("mean", "p10", "p90"):
        got, want = tuned[f"client_loss_finetune_{stat}"], tuned[f"client_loss_{stat}"]
        assert np.abs(got - want).max() < 1e-12 * want.abs().max()
