"""dataset=leaf, tff, hf: every sample and owner read back as written, the cache, natural clients in a run, and the
one-line errors of bad input (exit 2, nothing written)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import fedharness
from fedharness.cli import main
from fedharness.problems import federated, leaf
from fedharness.problems.leaf import LETTERS, load_leaf
from fedharness.problems.tff import BOS, CHARS, EOS, PAD, load_tff
from federated_fakes import assert_refused, leaf_images, leaf_text, write_leaf, write_tff_emnist, write_tff_shakespeare

USERS = ["f0007_12", "f0001_41", "f0113_02", "f0042_33", "f0003_40"]  # not in sorted order: clients come out sorted
RUN = ["rounds=2", "eval_every=1", "progress=false", "algorithm.clients_per_round=2", "algorithm.batch_size=2",
       "algorithm.local_steps=2", "reference=off"]


def _by_owner(data: federated.FederatedData, split: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    part = getattr(data, split)
    owners = np.asarray(data.names)[part.owner]
    assert (np.diff(part.owner) >= 0).all()  # grouped by client, in sorted owner order
    return {u: (np.asarray(part.x[owners == u]), part.y[owners == u]) for u in np.unique(owners)}


def _pixels(data: federated.FederatedData, x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64) * data.x_scale if data.x_scale is not None else x.astype(np.float64)


@pytest.mark.parametrize("codes", [True, False])
def test_leaf_images_every_sample_and_owner_as_written(tmp_path, codes):
    written = leaf_images(np.random.default_rng(0), USERS, codes=codes)
    write_leaf(tmp_path / "femnist", written)
    data = load_leaf(str(tmp_path / "femnist"), str(tmp_path / "cache"))
    assert data.names == sorted(USERS)
    assert (data.x_scale is not None) == codes and data.train.x.dtype == (np.uint8 if codes else np.float32)
    for split in ("train", "test"):
        got = _by_owner(data, split)
        assert sorted(got) == sorted(USERS)
        for user, (xs, ys) in written[split].items():
            x, y = got[user]
            assert x.shape == (len(xs), 1, 28, 28)
            want = np.asarray(xs)
            if codes:  # uint8 codes: the pixel to within float64 rounding of k/255
                np.testing.assert_allclose(_pixels(data, x).reshape(len(xs), -1), want, rtol=0, atol=1e-12)
            else:  # float32, exactly the written values rounded once
                np.testing.assert_array_equal(x.reshape(len(xs), -1), want.astype(np.float32))
            np.testing.assert_array_equal(y, ys)


def test_leaf_shakespeare_letters_and_next_letter(tmp_path):
    written = leaf_text(np.random.default_rng(1), USERS)
    write_leaf(tmp_path / "shakespeare", written, per_file=3)
    data = load_leaf(str(tmp_path / "shakespeare"), str(tmp_path / "cache"))
    assert data.num_classes == 81 == len(LETTERS) + 1 and data.x_scale is None and data.train.x.shape[1] == 80
    for split in ("train", "test"):
        got = _by_owner(data, split)
        for user, (xs, ys) in written[split].items():
            x, y = got[user]
            assert ["".join(LETTERS[i] for i in row) for row in x] == xs
            assert [LETTERS[i] for i in y] == ys


def test_cache_is_read_after_the_first_load_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    written = leaf_images(np.random.default_rng(2), USERS)
    write_leaf(tmp_path / "d", written)
    first = load_leaf(str(tmp_path / "d"), str(tmp_path / "cache"))
    assert [p.name for p in (tmp_path / "cache" / "federated").iterdir()] == [first.folder.name]

    def no_parsing(*args, **kwargs):
        raise AssertionError("the cached index must be read, not the JSON")

    monkeypatch.setattr(leaf, "parse_json", no_parsing)
    again = load_leaf(str(tmp_path / "d"), str(tmp_path / "cache"))
    assert isinstance(again.train.x, np.memmap)  # memory-mapped: read when touched
    np.testing.assert_array_equal(again.train.x, first.train.x)
    monkeypatch.undo()
    changed = dict(written["train"])
    changed[USERS[0]] = (changed[USERS[0]][0][:1], changed[USERS[0]][1][:1])
    write_leaf(tmp_path / "d", {"train": changed})
    rebuilt = load_leaf(str(tmp_path / "d"), str(tmp_path / "cache"))
    assert rebuilt.folder != first.folder and len(rebuilt.train.y) == len(first.train.y) - (
        len(written["train"][USERS[0]][1]) - 1)


def test_tff_emnist_every_sample_and_owner_as_written(tmp_path):
    clients = ["f3797_07", "f0001_02", "f2100_93"]
    written = write_tff_emnist(tmp_path / "emnist", np.random.default_rng(3), clients)
    data = load_tff(str(tmp_path / "emnist"), str(tmp_path / "cache"))
    assert data.names == sorted(clients) and data.x_scale == 1 / 255
    for split in ("train", "test"):
        got = _by_owner(data, split)
        for c, (pixels, label) in written[split].items():
            x, y = got[c]
            np.testing.assert_allclose(_pixels(data, x)[:, 0], pixels, rtol=0, atol=1e-7)
            np.testing.assert_array_equal(y, label)


def test_tff_shakespeare_tokens_and_windows(tmp_path):
    snippets = {"train": {"ROMEO": ["But soft!", "What light"], "JULIET": ["O Romeo, Romeo~"]},
                "test": {"ROMEO": ["Ay me"], "JULIET": ["Thou know'st"]}}
    write_tff_shakespeare(tmp_path / "sh", snippets)
    data = load_tff(str(tmp_path / "sh"), str(tmp_path / "cache"))
    assert data.num_classes == EOS + 1 == 90 and data.train.x.shape[1] == 80
    oov = len(CHARS) + 1
    for split, roles in snippets.items():
        got = _by_owner(data, split)
        for role, lines in roles.items():
            x, y = got[role]
            tokens = [[BOS, *(CHARS.index(c) + 1 if c in CHARS else oov for c in s), EOS] for s in lines]
            assert y.tolist() == [t for line in tokens for t in line[1:]]  # every token after bos, in order
            # each sample sees the 80 tokens before its target, left-padded with pad
            start = 0
            for line in tokens:
                for i in range(1, len(line)):
                    window = ([PAD] * 80 + line)[i:i + 80]
                    assert x[start + i - 1].tolist() == window
                start += len(line) - 1
    assert oov in data.train.y  # '~' is not in TFF's vocabulary


def _hf_rows(rng, clients, n_per):
    from PIL import Image
    import io

    rows = {"writer_id": [], "image": [], "character": [], "pixels": []}
    for c in clients:
        for _ in range(n_per[c]):
            pixels = rng.integers(0, 256, (28, 28), dtype=np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="PNG")
            rows["writer_id"].append(c)
            rows["image"].append({"bytes": buf.getvalue(), "path": None})
            rows["character"].append(int(rng.integers(0, 62)))
            rows["pixels"].append(pixels)
    return rows


def test_hf_saved_dataset_and_parquet_every_sample_and_owner(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(4)
    clients = ["w2", "w10", "w1"]
    train = _hf_rows(rng, clients, {"w2": 3, "w10": 2, "w1": 4})
    test = _hf_rows(rng, clients, {"w2": 1, "w10": 1, "w1": 1})
    features = datasets.Features({"writer_id": datasets.Value("string"), "image": datasets.Image(),
                                  "character": datasets.Value("int64")})
    saved = datasets.DatasetDict({s: datasets.Dataset.from_dict({k: v for k, v in rows.items() if k != "pixels"},
                                                                features=features)
                                  for s, rows in (("train", train), ("test", test))})
    saved.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "pq").mkdir()
    for split, rows in (("train", train), ("test", test)):  # the Hub's file names: train-00000-of-00001.parquet
        table = pa.table({"writer_id": rows["writer_id"], "x": [(p.reshape(-1) / 255).tolist() for p in rows["pixels"]],
                          "label": rows["character"]})
        pq.write_table(table, tmp_path / "pq" / f"{split}-00000-of-00001.parquet")
    from fedharness.problems.hf import load_hf

    for path in ("saved", "pq"):
        data = load_hf(str(tmp_path / path), "writer_id", cache_dir=str(tmp_path / "cache"))
        assert data.names == sorted(clients) and data.x_scale == 1 / 255
        for split, rows in (("train", train), ("test", test)):
            got = _by_owner(data, split)
            for c in clients:
                mine = [i for i, w in enumerate(rows["writer_id"]) if w == c]
                x, y = got[c]
                np.testing.assert_array_equal(x[:, 0], np.stack([rows["pixels"][i] for i in mine]))
                np.testing.assert_array_equal(y, [rows["character"][i] for i in mine])


def test_hf_text_columns_are_leaf_letters(tmp_path):
    """flwrlabs/shakespeare's layout: character_id, x (80 characters) and y (the next one), one split."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from fedharness.problems.hf import load_hf

    written = leaf_text(np.random.default_rng(10), USERS)["train"]
    rows = [(u, x, y) for u, (xs, ys) in written.items() for x, y in zip(xs, ys)]
    pq.write_table(pa.table({"character_id": [r[0] for r in rows], "x": [r[1] for r in rows],
                             "y": [r[2] for r in rows]}), tmp_path / "shakespeare.parquet")
    data = load_hf(str(tmp_path / "shakespeare.parquet"), "character_id", cache_dir=str(tmp_path / "cache"))
    assert data.num_classes == 81 and data.x_scale is None and data.test is None  # 80 letters and unknown
    got = _by_owner(data, "train")
    for user, (xs, ys) in written.items():
        x, y = got[user]
        assert ["".join(LETTERS[i] for i in row) for row in x] == xs and [LETTERS[i] for i in y] == ys


def _write_hf(folder, rng):
    import datasets

    rows = _hf_rows(rng, USERS, dict(zip(USERS, [3, 2, 4, 2, 3])))
    features = datasets.Features({"writer_id": datasets.Value("string"), "image": datasets.Image(),
                                  "character": datasets.Value("int64")})
    del rows["pixels"]
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(folder))


@pytest.mark.parametrize("kind", ["leaf_images", "leaf_text", "tff", "hf"])
@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 8 s idle
def test_a_run_on_natural_clients_ends_ok(tmp_path, kind):
    rng = np.random.default_rng(5)
    if kind == "tff":
        write_tff_emnist(tmp_path / "d", rng, USERS)
    elif kind == "hf":
        _write_hf(tmp_path / "d", rng)
    else:
        write_leaf(tmp_path / "d", leaf_images(rng, USERS) if kind == "leaf_images" else leaf_text(rng, USERS))
    name = kind.split("_")[0]
    column = ["dataset.client_column=writer_id"] if kind == "hf" else []
    # the readers' runs: logreg on images (model=auto is femnist_cnn, tests/test_natural_models.py); text: auto's
    # char_lstm (logreg cannot read token ids)
    model = [] if kind == "leaf_text" else ["model=logreg"]
    r = fedharness.run([f"dataset={name}", f"dataset.path={tmp_path / 'd'}", f"dataset.cache_dir={tmp_path / 'c'}",
                        f"results_dir={tmp_path / 'res'}", *RUN, *model, *column])
    assert r.runs.loc[0, "status"] == "ok" and r.runs.loc[0, "partition"] == "auto"
    # a saved data set without a test split has no test metrics
    assert len(r.rounds) == 3 and r.rounds["test_acc"].notna().all() == (kind != "hf")
    cfg = json.loads(r.runs.loc[0, "config_json"])
    assert cfg["dataset"]["num_clients"] is None


def test_natural_clients_are_the_owners_and_num_clients_draws_some(tmp_path):
    from fedharness.config.load import load_settings
    from fedharness.problems import build_problem

    written = leaf_images(np.random.default_rng(6), USERS)
    write_leaf(tmp_path / "d", written)
    base = [f"dataset=leaf", f"dataset.path={tmp_path / 'd'}", f"dataset.cache_dir={tmp_path / 'c'}", "model=logreg"]
    problem = build_problem(load_settings(base), 2)
    sizes = [len(written["train"][u][1]) for u in sorted(USERS)]
    assert problem.num_clients == 5 and problem.sizes.tolist() == sizes
    # the compact pixels become the written floats one minibatch at a time
    first = np.asarray(written["train"][sorted(USERS)[0]][0], dtype=np.float32)
    rows = problem._model_input(problem.x[:len(first)]).numpy()
    np.testing.assert_allclose(rows[:, :784], first, rtol=1e-6)  # logreg's inputs end with a 1 (the bias)
    # and the objective equals that of the same samples stored as float32
    from fedharness.problems.data import DataProblem
    import torch

    x, y, xt, yt = problem._raw
    index = [np.arange(o, o + n) for o, n in zip(problem.offsets, problem.sizes)]
    floats = DataProblem(problem.objective, np.asarray(x, np.float32) / 255, y, index,
                         np.asarray(xt, np.float32) / 255, yt, 2)
    w = torch.from_numpy(np.random.default_rng(0).normal(0, 0.01, (2, problem.dim)).astype(np.float32))
    np.testing.assert_allclose(problem.evaluate(w).train_loss, floats.evaluate(w).train_loss, rtol=1e-6)
    np.testing.assert_allclose(problem.evaluate(w).test_loss, floats.evaluate(w).test_loss, rtol=1e-6)
    three = build_problem(load_settings([*base, "dataset.num_clients=3", "dataset.data_seed=1"]), 2)
    chosen = np.sort(np.random.default_rng(1).choice(5, 3, replace=False))
    assert three.sizes.tolist() == [sizes[i] for i in chosen]
    iid = build_problem(load_settings([*base, "partition=iid"]), 2)  # iid over the pooled samples: 5 clients
    assert iid.num_clients == 5 and iid.sizes.sum() == sum(sizes) and iid.sizes.max() - iid.sizes.min() <= 1
    with pytest.raises(fedharness.ConfigError, match="dataset.num_clients.*at most the 5 clients"):
        build_problem(load_settings([*base, "dataset.num_clients=6"]), 2)


@pytest.fixture
def registered_here():
    """Data sets this test registers are gone afterwards (the registry and the config store as they were)."""
    from hydra.core.config_store import ConfigStore
    from fedharness import extend
    from fedharness.registry.groups import DATASETS

    saved, nodes = dict(DATASETS), dict(extend._NODES)
    repo = ConfigStore.instance().repo
    stored = set(repo.get("dataset", {}))
    yield
    DATASETS.clear()
    DATASETS.update(saved)
    extend._NODES.clear()
    extend._NODES.update(nodes)
    for name in set(repo.get("dataset", {})) - stored:
        del repo["dataset"][name]


def test_a_registered_data_set_with_owners_runs_natural(tmp_path, registered_here):
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(60, 4)), rng.integers(0, 3, 60)
    owner = np.repeat(["ann", "bob", "cy"], [10, 20, 30])
    fedharness.register_dataset("owned", lambda seed: ((x, y, owner), (x[:6], y[:6], owner[:6])), num_clients=3)
    r = fedharness.run(["dataset=owned", "partition=natural", f"results_dir={tmp_path / 'res'}", *RUN])
    assert r.runs.loc[0, "status"] == "ok"
    fedharness.register_dataset("unowned", lambda seed: ((x, y), None), num_clients=3)
    with pytest.raises(fedharness.ConfigError, match="'partition': 'natural'.*no owner per sample"):
        fedharness.run(["dataset=unowned", "partition=natural", f"results_dir={tmp_path / 'res2'}", *RUN])


def _bad_leaf(tmp_path, what):
    d = tmp_path / "data"
    write_leaf(d, leaf_images(np.random.default_rng(8), USERS[:2]))
    first = sorted((d / "train").glob("*.json"))[0]
    if what == "malformed":
        first.write_text(first.read_text()[:-20])
    elif what == "empty client":
        doc = json.loads(first.read_text())
        user = doc["users"][0]
        doc["user_data"][user], doc["num_samples"][0] = {"x": [], "y": []}, 0
        first.write_text(json.dumps(doc))
    elif what == "not leaf":
        first.write_text(json.dumps({"data": [1, 2]}))
    return d


BAD = [  # (what is wrong, overrides, the key named, words of what is expected)
    ("malformed", lambda d: ["dataset=leaf", f"dataset.path={d}"], "dataset.path", "not JSON"),
    ("not leaf", lambda d: ["dataset=leaf", f"dataset.path={d}"], "dataset.path", "expected LEAF JSON"),
    ("empty client", lambda d: ["dataset=leaf", f"dataset.path={d}"], "dataset.path", "no training samples"),
    ("missing path", lambda d: ["dataset=leaf"], "dataset.path", "required"),
    ("malformed h5", lambda d: ["dataset=tff", f"dataset.path={d}"], "dataset.path", "not an HDF5 file"),
    ("no such path", lambda d: ["dataset=tff", f"dataset.path={d}/nothing"], "dataset.path", "no such file"),
    ("no client column", lambda d: ["dataset=hf", f"dataset.path={d}", "dataset.client_column=user"],
     "dataset.client_column", "its columns: writer_id, x, label"),
]


@pytest.mark.parametrize("what,overrides,key,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, what, overrides, key, expected):
    if what == "malformed h5":
        d = tmp_path / "data"
        d.mkdir()
        (d / "fed_emnist_train.h5").write_bytes(b"<html>not found</html>")
    elif what == "no client column":
        import pyarrow as pa
        import pyarrow.parquet as pq

        (tmp_path / "data").mkdir()
        pq.write_table(pa.table({"writer_id": ["a"], "x": [[0.5] * 4], "label": [1]}),
                       tmp_path / "data" / "train-00000-of-00001.parquet")
        d = tmp_path / "data"
    elif what != "malformed h5":
        d = _bad_leaf(tmp_path, what)
    assert_refused(tmp_path, capsys, overrides(d), key, expected)


def test_rules_that_need_the_number_of_clients_wait_for_the_data(tmp_path, capsys):
    write_leaf(tmp_path / "d", leaf_images(np.random.default_rng(9), USERS))
    common = ["run", f"results_dir={tmp_path / 'res'}", "dataset=leaf", f"dataset.path={tmp_path / 'd'}",
              f"dataset.cache_dir={tmp_path / 'c'}", "progress=false"]
    assert main([*common, "algorithm.sampler=scheme_ii", "algorithm.clients_per_round=6"]) == 2
    assert main([*common, "num_shards=6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fedharness: error: invalid value for 'algorithm.clients_per_round': 6 (must be <= the number of "
                   "clients (5) when sampling without replacement)",
                   "fedharness: error: invalid value for 'num_shards': 6 (at most the number of clients "
                   "(dataset.num_clients = 5))"]
    assert not (tmp_path / "res").exists()


def test_natural_is_still_refused_for_centralised_image_sets(tmp_path, capsys):
    assert main(["run", f"results_dir={tmp_path / 'res'}", "partition=natural", "dataset=mnist"]) == 2
    err = capsys.readouterr().err
    assert "'partition'" in err and "owner per sample" in err and not os.path.exists(tmp_path / "res")
