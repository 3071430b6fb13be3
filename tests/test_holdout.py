"""dataset.holdout: a per-owner hold-out for federated data without a test split (harness/problems/federated.py)."""

from __future__ import annotations

import numpy as np
import pytest

import fedharness
from fedharness.errors import ConfigError
from fedharness.problems.federated import Split, hold_out
from federated_fakes import assert_refused

USERS = ["ann", "bob", "cy", "dee", "eve"]


def _split(sizes: list[int]) -> Split:
    owner = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(owner))  # owners interleaved: the hold-out must not rely on grouped storage
    return Split(np.arange(len(owner))[order, None], np.zeros(len(owner), np.int64), owner[order])


def test_every_owner_holds_out_its_share_drawn_by_the_seed():
    sizes = [1, 2, 3, 10, 57, 200]
    split = _split(sizes)
    train, test = hold_out(split, 0.25, seed=4)
    for k, n in enumerate(sizes):
        share = min(int(np.floor(0.25 * n + 0.5)), n - 1)  # round(f n_k), and one sample left to train on
        assert (test.owner == k).sum() == share and (train.owner == k).sum() == n - share
    ids = np.concatenate([train.x[:, 0], test.x[:, 0]])
    assert np.array_equal(np.sort(ids), np.arange(sum(sizes)))  # each sample in exactly one split
    np.testing.assert_array_equal(hold_out(split, 0.25, seed=4)[1].x, test.x)  # seeded
    assert not np.array_equal(hold_out(split, 0.25, seed=5)[1].x, test.x)  # another seed, other samples
    owner_order = split.owner[np.isin(split.x[:, 0], train.x[:, 0])]
    np.testing.assert_array_equal(train.owner, owner_order)  # the samples' order kept


def _write_hf_without_test(folder, rng):
    import datasets

    owner = [u for u, n in zip(USERS, [4, 6, 8, 10, 12]) for _ in range(n)]
    datasets.Dataset.from_dict({"writer_id": owner, "x": (rng.integers(0, 256, (len(owner), 16)) / 255).tolist(),
                                "label": rng.integers(0, 3, len(owner)).tolist()}).save_to_disk(str(folder))


def test_data_without_a_test_split_get_test_and_per_client_metrics_from_the_hold_out(tmp_path):
    pytest.importorskip("datasets")
    _write_hf_without_test(tmp_path / "d", np.random.default_rng(2))
    common = ["dataset=hf", "dataset.client_column=writer_id", f"dataset.path={tmp_path / 'd'}",
              f"dataset.cache_dir={tmp_path / 'c'}", "rounds=1", "eval_every=1", "progress=false",
              "eval.per_client=true", "algorithm.clients_per_round=2", "reference=off"]
    with pytest.raises(ConfigError, match="'eval.per_client': True .*no test set"):
        fedharness.run([*common, f"results_dir={tmp_path / 'r0'}"])
    r = fedharness.run([*common, "dataset.holdout=0.25", f"results_dir={tmp_path / 'r1'}"])
    assert r.runs.loc[0, "status"] == "ok"
    assert r.rounds[["test_loss", "test_acc", "client_acc_mean", "client_loss_mean"]].notna().all().all()


def test_a_hold_out_outside_0_1_is_one_line_and_nothing_is_written(tmp_path, capsys):
    for value in (0, 1, 1.5, -0.2):
        assert_refused(tmp_path, capsys, ["dataset=hf", "dataset.path=unused", "dataset.client_column=writer_id",
                                          f"dataset.holdout={value}"], "dataset.holdout", "in (0, 1)")
