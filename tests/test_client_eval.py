"""Per-client evaluation (eval.per_client): each client on its own held-out data, vectorized over clients and
replicas, equal to a plain loop over clients; the summary columns' definitions; FedBN's own buffers; the clients/
table; the held-out splits (by owner, label-matched); the sample of clients and its standard error."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from hydra.core.config_store import ConfigStore
from torch import nn

import fedharness
from fedharness.contracts import Callback, ClientScores
from fedharness.errors import ConfigError
from fedharness.problems import MODELS, build_problem
from fedharness.problems.client_eval import _by_owner, label_matched_split, evaluated_clients
from fedharness.runs.execute import build_engine, build_executor, execute, prepare_run

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

DIGITS = ["dataset=digits", "dataset.num_clients=6", "algorithm.batch_size=8", "algorithm.local_steps=2",
          "algorithm.sampler=full", "rounds=2", "eval_every=1", "heterogeneity=false", "reference=off"]


class BNMLP(nn.Module):
    """Linear - BatchNorm1d - ReLU - Linear: running statistics that FedBN keeps per client."""

    def __init__(self, in_shape, num_classes):
        super().__init__()
        self.fc1 = nn.Linear(int(np.prod(in_shape)), 12)
        self.bn = nn.BatchNorm1d(12)
        self.fc2 = nn.Linear(12, num_classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x.flatten(1)))))


@pytest.fixture
def bn_mlp():
    """`bn_mlp` registered for the test, the registries restored afterwards."""
    saved = dict(MODELS)
    repo = ConfigStore.instance().repo
    stored = set(repo.get("model", {}))
    fedharness.register_model("bn_mlp", BNMLP)
    yield "bn_mlp"
    MODELS.clear()
    MODELS.update(saved)
    for name in set(repo.get("model", {})) - stored:
        del repo["model"][name]


def loop_scores(problem, w: torch.Tensor, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The plain reference: each client's held-out samples through the model on their own (loss_terms), [R, S]."""
    loss, acc = np.zeros((len(w), len(clients))), np.zeros((len(w), len(clients)))
    with torch.no_grad():
        for j, k in enumerate(clients):
            rows = torch.as_tensor(problem.client_test[k])
            l, c = problem.objective.loss_terms(w, problem.x_test[rows], problem.y_test[rows])
            loss[:, j], acc[:, j] = l.double().numpy() / len(rows), c.double().numpy() / len(rows)
    return loss, acc


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


@pytest.mark.parametrize("model", ["logreg", "bn_mlp"])
def test_per_client_scores_equal_a_loop_over_clients_float64(run_config, bn_mlp, model):
    settings = run_config(*DIGITS, "dataset.num_clients=7", "partition=dirichlet", "partition.alpha=0.3",
                          f"model={model}", "dtype=float64", "eval.per_client=true")
    problem = build_problem(settings, 8)
    torch.manual_seed(0)
    w = problem.init_params(3, 0) + 0.3 * torch.randn(3, problem.dim, dtype=torch.float64)  # 3 replicas
    if problem.objective.buffer_dim:  # running variances must stay positive
        w[:, -problem.objective.buffer_dim:] = problem.init_params(3, 0)[:, -problem.objective.buffer_dim:].abs() + 0.5
    clients = np.arange(problem.num_clients)
    got = problem.client_scores(w, clients)
    want_loss, want_acc = loop_scores(problem, w, clients)
    assert got.loss.shape == (3, 7) and np.all(got.n > 0)
    assert rel(got.loss, want_loss) < 1e-6 and np.array_equal(got.acc, want_acc)
    assert not np.allclose(got.loss[0], got.loss[1])  # the replicas' own models, not one repeated
    # each test sample of a class some client trains on is one client's: the n-weighted mean is the pooled test_acc
    pooled = problem.evaluate(w)
    assert rel((got.acc * got.n).sum(1) / got.n.sum(), pooled.test_acc) < 1e-12


def test_chunked_and_sampled_scores_match_the_whole(run_config):
    settings = run_config(*DIGITS, "dtype=float64", "eval.per_client=true")
    problem = build_problem(settings, 8)
    w = torch.randn(2, problem.dim, dtype=torch.float64)
    whole = problem.client_scores(w, np.arange(6))
    problem.memory_budget = 4000  # a few samples per chunk
    assert problem.eval_chunk(2) < 20
    some = problem.client_scores(w, np.array([1, 4]))
    assert rel(some.loss, whole.loss[:, [1, 4]]) < 1e-12 and np.array_equal(some.n, whole.n[[1, 4]])


def test_summary_columns_definition():
    acc = np.round(np.linspace(0, 1, 11), 12)[None]  # 0.0, 0.1, ..., 1.0
    loss = np.array([[1.0, 2.0, 3.0, 4.0, *[np.nan] * 7]])
    n = np.array([5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0])  # only the first four clients have held-out samples
    every = ClientScores(np.arange(11), np.full(11, 5), acc, acc, population=11).columns(0)
    assert every["client_acc_mean"] == pytest.approx(0.5, rel=1e-12)
    assert (every["client_acc_p10"], every["client_acc_p50"], every["client_acc_p90"]) == pytest.approx(
        (0.1, 0.5, 0.9), rel=1e-12)
    assert every["client_acc_se"] is None  # every client evaluated: the mean is exact
    four = ClientScores(np.arange(11), n, loss, loss, population=11).columns(0)
    # linear interpolation between order statistics (numpy's default, type 7): p = 1 + q (4 - 1) over 1, 2, 3, 4
    assert (four["client_loss_p10"], four["client_loss_p50"], four["client_loss_p90"]) == pytest.approx(
        (1.3, 2.5, 3.7), rel=1e-12)
    assert four["client_loss_mean"] == 2.5
    sampled = ClientScores(np.arange(11), np.full(11, 5), acc, acc, population=20).columns(0)
    # sample std (ddof=1) of 0, 0.1, ..., 1 is sqrt(0.11); / sqrt(11) = 0.1; finite population: sqrt(1 - 11/20)
    assert sampled["client_acc_se"] == pytest.approx(0.1 * np.sqrt(0.45), rel=1e-12)


def test_label_matched_split_gives_each_client_its_training_label_mix():
    y_train = np.array([0] * 30 + [1] * 10 + [1] * 10)
    index = [np.arange(40), np.arange(40, 50)]  # client 0: 30 of class 0 and 10 of class 1; client 1: 10 of class 1
    y_test = np.array([1, 0] * 5 + [0, 0, 0] + [1] * 5 + [2, 2])  # 8 of class 0, 10 of class 1, 2 of class 2
    split = label_matched_split(y_train, index, y_test, seed=3)
    assert [np.bincount(y_test[s], minlength=3).tolist() for s in split] == [[8, 5, 0], [0, 5, 0]]
    owned = np.concatenate(split)
    assert len(np.unique(owned)) == len(owned) == 18  # class 2: nobody trains on it, nobody holds it out
    again = label_matched_split(y_train, index, y_test, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(split, again))
    other = label_matched_split(y_train, index, y_test, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(split, other))  # which class-1 samples: by the data seed


def test_test_owners_map_to_the_natural_partitions_clients():
    owner = np.array(["bob", "amy", "cat", "bob"])  # natural: clients in sorted owner order, amy 0, bob 1, cat 2
    test_owner = np.array(["cat", "zed", "amy", "cat", "bob"])  # zed trains nowhere: no client's
    assert [s.tolist() for s in _by_owner(owner, test_owner, 3)] == [[2], [4], [0, 3]]


def test_synthetic_clients_hold_out_their_own_samples(run_config):
    settings = run_config("dataset=synthetic", "dataset.num_clients=5", "eval.per_client=true")
    problem = build_problem(settings, 8)
    from fedharness.problems import synthetic

    for k in range(5):
        x, y = synthetic.client_data(settings.seed, k, 1.0, 1.0)
        held = y[synthetic.split_train_test(len(y)):]
        assert np.array_equal(problem.y_test[problem.client_test[k]].numpy(), held)


def test_sample_of_clients_is_fixed_uniform_and_distinct():
    a = evaluated_clients(7, 3550, 100)
    assert np.array_equal(a, evaluated_clients(7, 3550, 100)) and len(np.unique(a)) == 100
    assert np.all(np.diff(a) > 0) and a.max() < 3550
    assert not np.array_equal(a, evaluated_clients(8, 3550, 100))
    assert np.array_equal(evaluated_clients(7, 50, None), np.arange(50))
    assert np.array_equal(evaluated_clients(7, 50, 80), np.arange(50))
    hits = np.bincount(np.concatenate([evaluated_clients(s, 20, 5) for s in range(400)]), minlength=20)
    assert hits.min() > 60 and hits.max() < 140  # 100 expected per client


def test_run_writes_columns_and_clients_table(run_config, tmp_path):
    settings = run_config(*DIGITS, "replicas=2", "eval.per_client=true", "eval.clients=4", "eval.clients_table=true")
    result = execute(settings)
    rounds = pd.read_parquet(tmp_path / "results" / "rounds")
    clients = pd.read_parquet(tmp_path / "results" / "clients")
    assert result.status == "ok" and len(rounds) == 2 * 3
    assert len(clients) == 2 * 3 * 4 and sorted(clients.client.unique()) == sorted(evaluated_clients(settings.seed, 6, 4))
    for (rep, rnd), mine in clients.groupby(["replica", "round"]):
        row = rounds[(rounds.replica == rep) & (rounds["round"] == rnd)].iloc[0]
        assert row.client_acc_mean == pytest.approx(mine.acc.mean(), rel=1e-12)
        assert row.client_loss_p50 == pytest.approx(np.percentile(mine.loss, 50), rel=1e-12)
        assert row.client_acc_se == pytest.approx(mine.acc.std(ddof=1) / 2 * np.sqrt(1 - 4 / 6), rel=1e-12)
    assert rounds.client_acc_se.notna().all()


class LastScores(Callback):
    def __init__(self):
        self.scores: ClientScores | None = None

    def on_evaluation(self, context) -> None:
        self.scores = context.clients


class CrashAt(Callback):
    def __init__(self, round_: int):
        self.round = round_

    def on_evaluation(self, context) -> None:
        if context.round == self.round:
            raise RuntimeError(f"crashed at round {self.round}")


def test_fedbn_clients_are_scored_with_their_own_buffers(run_config, bn_mlp):
    settings = run_config(*DIGITS, f"model={bn_mlp}", "model.buffers=local", "dtype=float64", "replicas=2",
                          "eval.per_client=true")
    run = prepare_run(settings)
    executor = build_executor(run.settings, run.problem, run.algorithm.solver)
    seen = LastScores()
    outcome = build_engine(run, executor, [[seen]]).run()
    problem, x, b = run.problem, outcome.state.x, run.problem.objective.buffer_dim
    own = executor.get_state()
    assert sorted(own) == [(r, k) for r in range(2) for k in range(6)]
    want = np.zeros((2, 6))
    with torch.no_grad():
        for k in range(6):
            wk = x.clone()
            for r in range(2):
                wk[r, -b:] = own[(r, k)]["buffers"]
            rows = torch.as_tensor(problem.client_test[k])
            want[:, k] = problem.objective.loss_terms(wk, problem.x_test[rows], problem.y_test[rows])[0].numpy()
    assert rel(seen.scores.loss, want / seen.scores.n) < 1e-6
    server = problem.client_scores(x, np.arange(6))  # the server's averaged buffers instead
    assert rel(server.loss, seen.scores.loss) > 1e-4


def test_batched_slots_score_as_their_solo_runs(run_config):
    from fedharness.runs.batch import Slot
    from fedharness.runs.execute import execute_batch

    base = [*DIGITS, "eval.per_client=true", "dataset.data_seed=5"]
    slots = [run_config(*base, "seed=1"), run_config(*base, "seed=2", "replicas=2")]
    batched = execute_batch([Slot(s) for s in slots])
    for s, got in zip(slots, batched):
        alone = execute(s)
        cols = [c for c in pd.DataFrame(got.rows).columns if c.startswith("client_")]
        assert len(cols) == 10
        a, b = pd.DataFrame(got.rows)[cols].to_numpy(float), pd.DataFrame(alone.rows)[cols].to_numpy(float)
        assert np.allclose(a, b, rtol=1e-5, equal_nan=True)


def test_per_client_needs_held_out_data(run_config):
    """quadratic_lazy has neither held-out data nor per-client objectives to report (dataset=quadratic reports each
    client's f_k: tests/test_personal_eval.py)."""
    with pytest.raises(ConfigError, match="eval.per_client"):
        build_problem(run_config("dataset=quadratic_lazy", "eval.per_client=true"), 8)


def test_resumed_run_writes_each_clients_row_once_and_the_same(run_config, bn_mlp, tmp_path):
    run = [*DIGITS, f"model={bn_mlp}", "model.buffers=local", "rounds=5", "checkpoint_every=2", "replicas=2",
           "algorithm.sampler=scheme_i", "algorithm.clients_per_round=2", "eval.per_client=true",
           "eval.clients_table=true"]
    execute(run_config(*run, f"results_dir={tmp_path / 'whole'}"), run_id="whole")
    with pytest.raises(RuntimeError, match="crashed at round 3"):  # after round 2's checkpoint, round 3's rows
        execute(run_config(*run, f"results_dir={tmp_path / 'cut'}"), run_id="victim", callbacks=[CrashAt(3)])
    assert sorted(pd.read_parquet(tmp_path / "cut" / "clients")["round"].unique()) == [0, 1, 2, 3]
    execute(run_config(*run, f"results_dir={tmp_path / 'cut'}", "resume=victim"))
    key = ["round", "replica", "client"]
    got = pd.read_parquet(tmp_path / "cut" / "clients").sort_values(key).reset_index(drop=True)
    want = pd.read_parquet(tmp_path / "whole" / "clients").sort_values(key).reset_index(drop=True)
    assert len(got) == len(want) == 6 * 2 * 6 and not got.duplicated(key).any()
    assert got[[*key, "n"]].equals(want[[*key, "n"]])
    assert np.array_equal(got.loss.to_numpy(), want.loss.to_numpy())  # own buffers restored: the same bits




@pytest.mark.slow
def test_fedbn_scores_on_two_ray_shards_equal_inline(local_ray, run_config, bn_mlp, tmp_path):
    run = [*DIGITS, f"model={bn_mlp}", "model.buffers=local", "dtype=float64", "eval.per_client=true",
           "eval.clients_table=true"]
    execute(run_config(*run, f"results_dir={tmp_path / 'inline'}"))
    execute(run_config(*run, f"results_dir={tmp_path / 'ray'}", "executor=ray", "ray.num_shards=2"))
    key = ["round", "replica", "client"]
    got = pd.read_parquet(tmp_path / "ray" / "clients").sort_values(key).reset_index(drop=True)
    want = pd.read_parquet(tmp_path / "inline" / "clients").sort_values(key).reset_index(drop=True)
    assert len(got) == len(want) == 3 * 6
    assert np.array_equal(got.loss.to_numpy(), want.loss.to_numpy())  # own buffers gathered from the shards


@pytest.fixture
def owned_dataset():
    """`owned`: a Python-registered data set that names each sample's owner, train and test (as LEAF's loader
    does); the registries restored afterwards."""
    from fedharness.problems import DATASETS
    from fedharness.problems.pooled import PooledData

    def make(seed):
        rng = np.random.default_rng(seed)
        owners = np.array(["w3", "w1", "w2"])
        owner, test_owner = rng.choice(owners, 90), np.concatenate([owners.repeat(4), ["w9"]])  # w9: no training
        return PooledData(rng.standard_normal((90, 5)), rng.integers(0, 3, 90), rng.standard_normal((13, 5)),
                          rng.integers(0, 3, 13), owner, test_owner)

    saved = dict(DATASETS)
    repo = ConfigStore.instance().repo
    stored = set(repo.get("dataset", {}))
    fedharness.register_dataset("owned", make, num_clients=3)
    yield make
    DATASETS.clear()
    DATASETS.update(saved)
    for name in set(repo.get("dataset", {})) - stored:
        del repo["dataset"][name]


def test_a_data_sets_test_owners_are_the_clients_held_out_data(run_config, owned_dataset):
    problem = build_problem(run_config("dataset=owned", "dataset.data_seed=4", "eval.per_client=true"), 8)
    pooled = owned_dataset(4)
    for k, name in enumerate(["w1", "w2", "w3"]):  # natural (auto): clients in sorted owner order
        assert np.array_equal(problem.client_test[k], np.flatnonzero(pooled.test_owner == name))
        assert np.array_equal(problem.y[problem.offsets[k]:problem.offsets[k] + problem.sizes[k]].numpy(),
                              pooled.y[pooled.owner == name])
    scores = problem.client_scores(problem.init_params(1, 0) + 0.1, np.arange(3))
    assert scores.n.tolist() == [4, 4, 4]  # w9's test sample is no client's


def test_per_client_on_a_data_set_without_held_out_data_exits_2_writing_nothing(tmp_path, capsys):
    from fedharness.cli import main

    results = tmp_path / "r"
    assert main(["run", "dataset=quadratic_lazy", "eval.per_client=true", f"results_dir={results}", "progress=false"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "fedharness: error: invalid value for 'eval.per_client': True (false: dataset=quadratic_lazy has no held-out "
        "data per client (per-client evaluation needs a data set with a test set))"]
    assert not results.exists()


def test_more_clients_to_evaluate_than_there_are_is_refused(run_config):
    with pytest.raises(ConfigError, match=r"'eval.clients': 7 \(null \(every client\) or at most the 6 clients\)"):
        build_problem(run_config(*DIGITS, "eval.per_client=true", "eval.clients=7"), 8)


def test_own_buffer_clients_scored_in_batches_equal_one_at_a_time(run_config, bn_mlp, monkeypatch):
    import fedharness.problems.client_eval as client_eval

    settings = run_config(*DIGITS, "dataset.num_clients=7", "partition=dirichlet", "partition.alpha=0.5",
                          f"model={bn_mlp}", "model.buffers=local", "dtype=float64", "eval.per_client=true",
                          "replicas=2")
    problem = build_problem(settings, 8)
    b = problem.objective.buffer_dim
    w = problem.init_params(2, 0) + 0.2 * torch.randn(2, problem.dim, dtype=torch.float64,
                                                      generator=torch.Generator().manual_seed(3))
    w[:, -b:] = w[:, -b:].abs() + 0.5  # running variances stay positive
    own = {(r, k): w[r, -b:] * (1 + 0.3 * k + 0.1 * r) for r in range(2) for k in (0, 2, 3, 5, 6)}  # not 1, 4
    want = np.zeros((2, 7))
    with torch.no_grad():
        for k in range(7):
            wk = w.clone()
            for r in range(2):
                if (r, k) in own:
                    wk[r, -b:] = own[(r, k)]
            rows = torch.as_tensor(problem.client_test[k])
            want[:, k] = problem.objective.loss_terms(wk, problem.x_test[rows], problem.y_test[rows])[0].numpy()
    sizes = sorted(len(problem.client_test[k]) for k in (0, 2, 3, 5, 6))
    batches: list[list[int]] = []
    real = client_eval._own_buffer_batch
    monkeypatch.setattr(client_eval, "_own_buffer_batch", lambda *a: (batches.append(list(a[6])), real(*a))[1])
    # a chunk that holds two clients' padded samples but not all five, and leaves the largest to the loop
    chunk = sizes[-2] * 2
    monkeypatch.setattr(problem, "eval_chunk", lambda replicas: chunk)
    got = problem.client_scores(w, np.arange(7), own)
    assert rel(got.loss, want / got.n) < 1e-6
    fits = [k for k in (0, 2, 3, 5, 6) if len(problem.client_test[k]) <= chunk]  # the others: one at a time
    assert sorted(j for batch in batches for j in batch) == fits and len(batches) > 1
    for batch in batches:  # padded samples of a batch within the chunk
        assert len(batch) * max(len(problem.client_test[j]) for j in batch) <= chunk


def test_blobs_clients_hold_out_the_test_samples_drawn_with_theirs(run_config):
    settings = run_config("dataset=blobs", "dataset.num_clients=4", "dataset.samples_per_client=30",
                          "dataset.variant=heterogeneous", "eval.per_client=true")
    problem = build_problem(settings, 8)
    assert [s.tolist() for s in problem.client_test] == [list(range(3 * k, 3 * k + 3)) for k in range(4)]


TUNE_P10 = ["tune", "tune=default", "dataset=synthetic", "dataset.num_clients=8", "tune.n_trials=1",
            "tune.budget.total=20", "tune.space.local_steps.high=4", "tune.plots=false",
            "tune.objective.metric=client_acc_p10", "progress=false"]


def test_a_study_for_the_worst_clients_needs_per_client_evaluation(tmp_path, capsys):
    from fedharness.cli import main

    assert main([*TUNE_P10, f"results_dir={tmp_path / 'r'}"]) == 2 and not (tmp_path / "r").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'tune.objective.metric': 'client_acc_p10'" in err[0] and "eval.per_client" in err[0]


@pytest.mark.slow
def test_a_study_tunes_for_the_worst_clients(tmp_path):
    from fedharness.cli import main

    results = tmp_path / "results"
    assert main([*TUNE_P10, "eval.per_client=true", f"results_dir={results}"]) == 0
    trials = pd.read_parquet(results / "trials")
    rounds = pd.read_parquet(results / "rounds")
    assert (trials.direction == "maximize").all() and len(trials) == 1
    for t in trials.itertuples():  # the score: the final round's client_acc_p10, mean over replicas
        mine = rounds[rounds.run_id == t.run_id]
        assert t.value == pytest.approx(mine[mine["round"] == mine["round"].max()].client_acc_p10.mean(), rel=1e-12)
