"""dataset=tff StackOverflow and dataset=leaf Sent140: every sample and owner as written (word ids, windows,
the vocabularies), model=sent_lstm, runs with per-client evaluation on each federated format, and the one-line
errors of bad input (exit 2, nothing written)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import fedharness
from fedharness.problems.leaf import load_leaf
from fedharness.problems.nets import build_net, count_params
from fedharness.problems.tff import load_tff
from federated_fakes import (assert_refused, leaf_images, leaf_sent140, leaf_text, write_leaf, write_tff_emnist,
                             write_tff_stackoverflow)

USERS = ["u7", "u1", "u30", "u2"]  # not sorted: clients come out sorted
COUNTS = [("the", 900), ("to", 800), ("i", 700), ("a", 600), ("numpy", 500), ("array", 400), ("how", 300)]
WORDS = ["the", "to", "i", "a", "numpy", "array", "how", "pandas~", "rare"]  # the last two never counted


def _by_owner(data, split):
    part = getattr(data, split)
    owners = np.asarray(data.names)[part.owner]
    assert (np.diff(part.owner) >= 0).all()  # grouped by client, in sorted owner order
    return {u: (np.asarray(part.x[owners == u]), part.y[owners == u]) for u in np.unique(owners)}


def _sentences(rng, users, counts):
    """Each user's sentences: 1 to 25 words (over TFF's 20 for some), one exactly 20."""
    return {u: [" ".join(rng.choice(WORDS, n)) for n in [*rng.integers(1, 26, counts), 20]] for u in users}


def test_tff_stackoverflow_word_ids_and_windows(tmp_path):
    rng = np.random.default_rng(0)
    sentences = {"train": _sentences(rng, USERS, 2), "test": _sentences(rng, USERS[:2], 1)}
    write_tff_stackoverflow(tmp_path / "so", sentences, COUNTS)
    size = 5  # the, to, i, a, numpy: array and how are out of the vocabulary as pandas~ and rare are
    data = load_tff(str(tmp_path / "so"), str(tmp_path / "cache"), vocab_size=size)
    pad, oov, bos, eos = 0, size + 1, size + 2, size + 3
    assert data.num_classes == data.token_vocab == size + 4 and data.x_scale is None and data.train.x.shape[1] == 20
    assert data.train.x.dtype == np.int32 and data.names == sorted(USERS)
    ids = {w: i + 1 for i, (w, _) in enumerate(COUNTS[:size])}
    for split, users in sentences.items():
        got = _by_owner(data, split)
        assert sorted(got) == sorted(users)
        for user, lines in users.items():
            x, y = got[user]
            rows = []
            for line in lines:
                words = line.split(" ")[:20]
                rows.append([bos, *(ids.get(w, oov) for w in words)] + ([eos] if len(words) < 20 else []))
            assert y.tolist() == [t for row in rows for t in row[1:]]
            windows = [([pad] * 20 + row)[i:i + 20] for row in rows for i in range(1, len(row))]
            assert x.tolist() == windows
    assert oov in data.train.y and eos in data.train.y


def _tweet_vocabulary(train, size):
    """Sent140's vocabulary computed here: the `size` most frequent words, ties first seen first."""
    counts, first = {}, {}
    for records, _ in train.values():
        for r in records:
            for w in re.findall(r"[\w']+|[.,!?;]", r[4]):
                counts[w] = counts.get(w, 0) + 1
                first.setdefault(w, len(first))
    ranked = sorted(counts, key=lambda w: (-counts[w], first[w]))[:size]
    return {w: i + 2 for i, w in enumerate(ranked)}


def test_leaf_sent140_word_ids_labels_and_owners(tmp_path):
    written = leaf_sent140(np.random.default_rng(1), USERS, ["good", "bad", "day", "don't", "go!", "ok,", "meh"])
    write_leaf(tmp_path / "sent140", written, per_file=3)
    data = load_leaf(str(tmp_path / "sent140"), str(tmp_path / "cache"), vocab_size=6)
    assert data.num_classes == 2 and data.token_vocab == 6 + 2 and data.x_scale is None and data.train.x.shape[1] == 25
    vocab = _tweet_vocabulary(written["train"], 6)
    assert len(vocab) == 6 and sorted(vocab.values()) == list(range(2, 8))
    for split in ("train", "test"):
        got = _by_owner(data, split)
        assert sorted(got) == sorted(USERS)
        for user, (records, labels) in written[split].items():
            x, y = got[user]
            want = []
            for r in records:
                ids = [vocab.get(w, 1) for w in re.findall(r"[\w']+|[.,!?;]", r[4])][:25]
                want.append(ids + [0] * (25 - len(ids)))
            assert x.tolist() == want and y.tolist() == labels
    assert 1 in data.train.x  # some words are out of the vocabulary


def test_sent_lstm_parameters_and_padding_after_the_words():
    lstm = lambda i, h: 4 * h * (i + h) + 4 * h  # one bias per layer, as TF/Keras
    net = build_net("sent_lstm", (25,), 2, token_vocab=10_002)  # 10,000 words, pad, oov
    assert count_params(net) == 10_002 * 100 + lstm(100, 100) * 2 + (100 * 128 + 128) + (128 * 2 + 2) == 1_174_186
    torch.manual_seed(0)
    small = build_net("sent_lstm", (25,), 2, token_vocab=22)
    words = torch.randint(2, 22, (3, 7))
    padded = torch.cat([words, torch.zeros(3, 18, dtype=torch.int64)], dim=1)
    # pad steps leave the state: the padded tweet's logits are its words' alone
    torch.testing.assert_close(small(padded), small(words), rtol=1e-6, atol=1e-6)
    assert small(padded).shape == (3, 2)


def test_sent_lstm_embeds_the_data_sets_ids(tmp_path):
    from fedharness.config.load import load_settings
    from fedharness.problems import build_problem

    write_leaf(tmp_path / "d", leaf_sent140(np.random.default_rng(4), USERS, ["good", "bad", "day", "meh", "ok"]))
    base = ["dataset=leaf", f"dataset.path={tmp_path / 'd'}", f"dataset.cache_dir={tmp_path / 'c'}", "model=sent_lstm"]
    for size in (3, 5):  # the vocabulary's words, pad and oov: the embedding's rows
        problem = build_problem(load_settings([*base, f"dataset.vocab_size={size}"]), 2)
        assert problem.objective.net.embedding.num_embeddings == size + 2
        assert int(problem.x.max()) == size + 1  # every word of the vocabulary is in the training split
    with pytest.raises(fedharness.ConfigError, match="'model': 'sent_lstm'.*int64 token ids"):
        build_problem(load_settings(["dataset=blobs", "model=sent_lstm"]), 2)


def _write_hf(folder, rng):
    """A saved DatasetDict with a client column: x flat 16 pixels k/255, label, writer_id, train and test."""
    import datasets

    def rows(n_per):
        owner = [u for u in USERS for _ in range(n_per)]
        return {"writer_id": owner, "x": (rng.integers(0, 256, (len(owner), 16)) / 255).tolist(),
                "label": rng.integers(0, 3, len(owner)).tolist()}

    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows(4)),
                          "test": datasets.Dataset.from_dict(rows(2))}).save_to_disk(str(folder))


def _write(kind, folder, rng):
    if kind == "leaf_images":
        write_leaf(folder, leaf_images(rng, USERS))
    elif kind == "leaf_shakespeare":
        write_leaf(folder, leaf_text(rng, USERS))
    elif kind == "leaf_sent140":
        write_leaf(folder, leaf_sent140(rng, USERS, ["good", "bad", "day", "meh"]))
    elif kind == "tff_emnist":
        write_tff_emnist(folder, rng, USERS)
    elif kind == "tff_stackoverflow":
        write_tff_stackoverflow(folder, {"train": _sentences(rng, USERS, 2), "test": _sentences(rng, USERS, 1)},
                                COUNTS)
    else:
        _write_hf(folder, rng)


RUNS = {  # kind -> its overrides besides the path
    "leaf_images": ["dataset=leaf", "model=logreg"],  # the readers' runs (model=auto: tests/test_natural_models.py)
    "leaf_shakespeare": ["dataset=leaf", "model=char_lstm", "algorithm.local_steps=1", "algorithm.batch_size=4"],
    "leaf_sent140": ["dataset=leaf", "dataset.vocab_size=4", "model=sent_lstm", "algorithm.local_steps=1",
                     "algorithm.batch_size=4"],
    "tff_emnist": ["dataset=tff", "model=logreg"],
    "tff_stackoverflow": ["dataset=tff", "dataset.vocab_size=5", "model=word_lstm", "algorithm.local_steps=1",
                          "algorithm.batch_size=4"],
    "hf": ["dataset=hf", "dataset.client_column=writer_id", "model=logreg"],
}
SLOW = {"tff_stackoverflow"}  # word_lstm: 4M parameters, the LSTM of 670 on CPU (7 s)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW else k for k in RUNS])
@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 11 s idle
def test_a_run_with_per_client_evaluation_ends_ok(tmp_path, kind):
    _write(kind, tmp_path / "d", np.random.default_rng(2))
    r = fedharness.run([*RUNS[kind], f"dataset.path={tmp_path / 'd'}", f"dataset.cache_dir={tmp_path / 'c'}",
                        f"results_dir={tmp_path / 'res'}", "rounds=2", "eval_every=1", "progress=false",
                        "eval.per_client=true", "algorithm.clients_per_round=2", "reference=off"])
    assert r.runs.loc[0, "status"] == "ok", r.runs.loc[0].to_dict()
    columns = [f"client_{m}_{s}" for m in ("acc", "loss") for s in ("mean", "p10", "p50", "p90")]
    assert len(r.rounds) == 3 and r.rounds[columns].notna().all().all()
    # every client is evaluated (eval.clients null): the mean is exact, it has no standard error
    assert r.rounds[["client_acc_se", "client_loss_se"]].isna().all().all()
    accs = r.rounds[["client_acc_p10", "client_acc_p50", "client_acc_p90"]].to_numpy()
    assert ((accs >= 0) & (accs <= 1)).all() and (np.diff(accs, axis=1) >= 0).all()  # quantiles in order
    assert json.loads(r.runs.loc[0, "config_json"])["eval"]["per_client"] is True


def _bad(tmp_path, what):
    d = tmp_path / "data"
    if what == "malformed tweet":
        written = leaf_sent140(np.random.default_rng(3), USERS[:2], ["good", "bad"])
        written["train"][USERS[1]][0][1] = ["1467810369", "Mon Apr 06", "NO_QUERY", "u1"]  # no text
        write_leaf(d, written)
    elif what == "bad sentiment":
        written = leaf_sent140(np.random.default_rng(3), USERS[:2], ["good", "bad"])
        written["test"][USERS[0]][1][0] = 4  # Sentiment140's raw positive label, not LEAF's 1
        write_leaf(d, written)
    else:
        write_tff_stackoverflow(d, {"train": _sentences(np.random.default_rng(3), USERS[:2], 1)}, COUNTS)
        if what == "no word counts":
            (d / "stackoverflow.word_count").unlink()
        elif what == "malformed word counts":
            (d / "stackoverflow.word_count").write_text("the 900\nto eight hundred\n")
    return d


BAD = [  # (what is wrong, overrides, the key named, words of what is expected)
    ("no word counts", lambda d: ["dataset=tff", f"dataset.path={d}"], "dataset.vocab_path",
     "stackoverflow.word_count' (no such file: TFF's stackoverflow.word_count"),
    ("no vocab_path", lambda d: ["dataset=tff", f"dataset.path={d}", f"dataset.vocab_path={d}/counts.txt"],
     "dataset.vocab_path", "counts.txt' (no such file"),
    ("malformed word counts", lambda d: ["dataset=tff", f"dataset.path={d}"], "dataset.vocab_path",
     "line 2 is 'to eight hundred': expected \"word count\""),
    ("malformed tweet", lambda d: ["dataset=leaf", f"dataset.path={d}"], "dataset.path",
     "x[1] is ['1467810369', 'Mon Apr 06', 'NO_QUERY', 'u1']: expected Sent140's [tweet_id, date, query, user, text]"),
    ("bad sentiment", lambda d: ["dataset=leaf", f"dataset.path={d}"], "dataset.path",
     "y 4: expected Sent140's sentiment 0 or 1"),
]


@pytest.mark.parametrize("what,overrides,key,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys, what, overrides, key, expected):
    d = _bad(tmp_path, what)
    assert_refused(tmp_path, capsys, overrides(d), key, expected)
