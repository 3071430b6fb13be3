"""model=auto on natural-client data (LEAF, TFF, Hugging Face): the data's own model, which trains at the default
step size; characters and words outside the vocabulary read, counted and reported; owners' names in clients/."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pandas as pd
import pytest

import fedharness
from fedharness.cli import main
from fedharness.config.load import load_config
from fedharness.problems.leaf import LETTERS, UNKNOWN, letter_ids
from federated_fakes import assert_refused, write_leaf, write_tff_emnist

ROLES = [f"THE_TRAGEDY_OF_HAMLET_{name}" for name in ("HAMLET", "OPHELIA", "HORATIO", "GHOST", "LAERTES", "OSRIC")]
# Gutenberg text as LEAF's preprocessing keeps it: `_`, `{`, `}`-less braces, `@` and a non-ASCII letter are
# outside LEAF's 80 letters
PHRASE = "to be, or not to be, that is the question: whether 'tis _nobler_ in the mind {to} suffer @ the slings é "
WINDOW = 10  # characters a window holds (LEAF's are 80; the reader takes any one length): a fast char_lstm


def shakespeare(rng: np.random.Generator, window: int = WINDOW) -> dict:
    """Each role's windows of a repeated line (learnable: its next character follows from the window), the
    next character each, 25 train and 5 test windows per role."""
    out: dict = {"train": {}, "test": {}}
    for role in ROLES:
        start = int(rng.integers(0, len(PHRASE)))
        text = (PHRASE * 4)[start:start + window + 30]
        xs, ys = [text[i:i + window] for i in range(30)], [text[i + window] for i in range(30)]
        out["train"][role], out["test"][role] = (xs[:25], ys[:25]), (xs[25:], ys[25:])
    return out


def femnist(rng: np.random.Generator, classes: int = 10) -> dict:
    """Writers' 28 x 28 images as LEAF writes them (784 pixels k/255): class c lights rows 2c..2c+3 (learnable),
    over noise; 10 train and 3 test images per writer."""
    out: dict = {"train": {}, "test": {}}
    for writer in [f"f{i:04d}_{i % 7}" for i in range(6)]:
        labels = rng.integers(0, classes, 13)
        images = rng.integers(0, 64, (13, 28, 28))
        for image, label in zip(images, labels):
            image[2 * label:2 * label + 4] = 255
        pixels = (images.reshape(13, -1) / 255).tolist()
        out["train"][writer] = (pixels[:10], labels[:10].tolist())
        out["test"][writer] = (pixels[10:], labels[10:].tolist())
    return out


def sent140(rng: np.random.Generator) -> dict:
    """Tweets whose sentiment follows their words (happy words: 1, sad words: 0), 8 train and 2 test per user."""
    happy, sad = ["good", "great", "love", "fun"], ["bad", "sad", "hate", "awful"]
    out: dict = {"train": {}, "test": {}}
    tweet_id = 1467810369
    for user in ["alice_w", "bob_88", "carol", "dave_x", "erin", "frank"]:
        records, labels = [], []
        for _ in range(10):
            label = int(rng.integers(0, 2))
            text = " ".join(rng.choice(happy if label else sad, int(rng.integers(2, 6))))
            records.append([str(tweet_id), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user, text])
            labels.append(label)
            tweet_id += 1
        out["train"][user], out["test"][user] = (records[:8], labels[:8]), (records[8:], labels[8:])
    return out


def _outside(text: str) -> bool:
    return any(c not in LETTERS for c in text)


FOLDERS = {  # shape -> (its writer, the model auto picks, V: the classes uniform guessing spreads over)
    "shakespeare": (shakespeare, "char_lstm", len(LETTERS) + 1),
    "femnist": (femnist, "femnist_cnn", 10),
    "sent140": (sent140, "sent_lstm", 2),
}


def _base(tmp_path) -> list[str]:
    return ["dataset=leaf", f"dataset.path={tmp_path / 'd'}", f"dataset.cache_dir={tmp_path / 'c'}",
            f"results_dir={tmp_path / 'res'}", "progress=false"]


@pytest.mark.parametrize("shape", list(FOLDERS))
def test_auto_is_the_datas_model_shown_by_cfg_job(tmp_path, capsys, shape):
    write, model, _ = FOLDERS[shape]
    write_leaf(tmp_path / "d", write(np.random.default_rng(0)))
    assert main(["run", *_base(tmp_path), "--cfg", "job"]) == 0
    assert f"model:\n  name: {model}\n" in capsys.readouterr().out


def test_a_model_named_is_kept_and_other_data_keep_logistic_regression(tmp_path):
    write_leaf(tmp_path / "d", femnist(np.random.default_rng(0)))
    assert load_config([*_base(tmp_path), "model=logreg", "model.l2=0.01"])["model"] == {"name": "logreg", "l2": 0.01}
    assert load_config([*_base(tmp_path), "model.l2=0.01"])["model"] == {"name": "femnist_cnn", "l2": 0.01}
    assert load_config(["dataset=synthetic"])["model"]["name"] == "auto"


def test_auto_on_tff_and_hugging_face(tmp_path, caplog):
    write_tff_emnist(tmp_path / "t", np.random.default_rng(1), ["w0", "w1"])
    (tmp_path / "t" / "fed_emnist_test.h5").unlink()
    tff = ["dataset=tff", f"dataset.path={tmp_path / 't'}", f"dataset.cache_dir={tmp_path / 'c'}"]
    with caplog.at_level(logging.INFO, logger="fedharness"):
        assert load_config(tff)["model"]["name"] == "femnist_cnn"
    assert "no test file beside fed_emnist_train.h5 (no *test*.h5)" in caplog.text  # said at the first load
    _write_hf_text(tmp_path / "h", shakespeare(np.random.default_rng(2)))
    hf = ["dataset=hf", f"dataset.path={tmp_path / 'h'}", "dataset.client_column=role",
          f"dataset.cache_dir={tmp_path / 'c'}"]
    assert load_config(hf)["model"]["name"] == "char_lstm"


@pytest.mark.slow  # a char LSTM, a CNN of 6.6M parameters and a sentence LSTM trained on CPU: 4 to 11 s each
@pytest.mark.parametrize("shape", list(FOLDERS))
def test_leaf_run_with_no_model_trains(tmp_path, capsys, shape):
    """Done when: `fedharness run dataset=leaf dataset.path=DIR` with no model= exits 0, status ok, its final test
    loss below round 0's and below ln(V); at the default step size (algorithm.client_lr)."""
    write, model, classes = FOLDERS[shape]
    write_leaf(tmp_path / "d", write(np.random.default_rng(0)))
    code = main(["run", *_base(tmp_path), "rounds=4", "eval_every=4", "algorithm.clients_per_round=3",
                 "algorithm.local_steps=5", "algorithm.batch_size=5", "eval.per_client=true",
                 "eval.clients_table=true", "threads=1"])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0 and "status=ok" in out, out
    if shape == "shakespeare":  # its text holds characters outside LEAF's 80: the first load says how many
        assert "character outside LEAF's 80 letters is read as id 80; train: " in captured.err, captured.err
    assert "client_acc_mean" in out and "client_acc_p50" in out  # the CLI summary's per-client accuracy
    runs, rounds = (pd.read_parquet(tmp_path / "res" / table) for table in ("runs", "rounds"))
    assert runs.loc[0, "model"] == model and json.loads(runs.loc[0, "config_json"])["model"]["name"] == model
    rounds = rounds.sort_values("round")
    first, last = rounds["test_loss"].iloc[0], rounds["test_loss"].iloc[-1]
    assert last < first and last < math.log(classes), (first, last)
    clients = pd.read_parquet(tmp_path / "res" / "clients")  # clients named by their owners, sorted
    written = sorted(write(np.random.default_rng(0))["train"])
    assert clients.groupby("client")["owner"].first().tolist() == written


def _write_hf_text(folder, samples: dict) -> None:
    """flwrlabs/shakespeare's columns as Parquet files (train-*, test-*): role, x (a window), y (the next one)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    for split, roles in samples.items():
        rows = [(role, x, y) for role, (xs, ys) in roles.items() for x, y in zip(xs, ys)]
        pq.write_table(pa.table({"role": [r[0] for r in rows], "x": [r[1] for r in rows], "y": [r[2] for r in rows]}),
                       folder / f"{split}-00000-of-00001.parquet")


def _expected_counts(samples: dict) -> dict:
    """The windows holding a character outside LEAF's 80 letters, and the targets that are one, counted here
    from the strings written."""
    out = {}
    for split, roles in samples.items():
        xs = [x for xs, _ in roles.values() for x in xs]
        ys = [y for _, ys in roles.values() for y in ys]
        out[split] = {"samples": len(xs), "windows": sum(map(_outside, xs)), "targets": sum(map(_outside, ys))}
    return out


@pytest.mark.parametrize("reader", ["leaf", "hf"])
def test_characters_outside_leafs_letters_read_as_unknown_and_counted(tmp_path, caplog, reader):
    from fedharness.problems.hf import load_hf
    from fedharness.problems.leaf import load_leaf

    samples = shakespeare(np.random.default_rng(3))
    expected = _expected_counts(samples)
    assert expected["train"]["windows"] > 0 and expected["train"]["targets"] > 0  # the test's text holds some
    if reader == "leaf":
        write_leaf(tmp_path / "d", samples)
        load = lambda: load_leaf(str(tmp_path / "d"), str(tmp_path / "c"))  # noqa: E731
    else:
        _write_hf_text(tmp_path / "d", samples)
        load = lambda: load_hf(str(tmp_path / "d"), "role", cache_dir=str(tmp_path / "c"))  # noqa: E731
    with caplog.at_level(logging.INFO, logger="fedharness"):
        data = load()
    assert data.num_classes == data.token_vocab == len(LETTERS) + 1 == UNKNOWN + 1
    assert {k: data.unknown[k] for k in ("train", "test")} == expected and data.unknown["id"] == UNKNOWN
    line = (f"train: {expected['train']['windows']} of {expected['train']['samples']} windows hold one, "
            f"{expected['train']['targets']} targets are one")
    assert [r.getMessage() for r in caplog.records if "LEAF's 80 letters" in r.getMessage()] == [
        f"dataset={reader}: a character outside LEAF's 80 letters is read as id 80; {line}; test: "
        f"{expected['test']['windows']} of {expected['test']['samples']} windows hold one, "
        f"{expected['test']['targets']} targets are one"]
    # each window's ids: its letters' places in LETTERS, every other character the one unknown id (targets too)
    roles = sorted(samples["train"])
    xs = [x for role in roles for x in samples["train"][role][0]]
    ys = [y for role in roles for y in samples["train"][role][1]]
    want = np.array([[LETTERS.find(c) if c in LETTERS else UNKNOWN for c in x] for x in xs])
    assert np.array_equal(data.train.x, want)
    assert np.array_equal(data.train.y, [LETTERS.find(c) if c in LETTERS else UNKNOWN for c in ys])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fedharness"):
        load()  # from the cache: said once, at the first load
    assert "LEAF's 80 letters" not in caplog.text


def test_letter_ids_of_any_code_point():
    ids = letter_ids(["a_\u00e9{\n", "Z}~@\u00ff", "\u20ac\U0001f600 .?"])  # 5 characters each, 255 and above too
    letter = LETTERS.index
    assert ids.tolist() == [[letter("a"), UNKNOWN, UNKNOWN, UNKNOWN, letter("\n")],
                            [letter("Z"), letter("}"), UNKNOWN, UNKNOWN, UNKNOWN],
                            [UNKNOWN, UNKNOWN, letter(" "), letter("."), letter("?")]]


def test_a_linear_model_on_token_ids_is_refused(tmp_path, capsys):
    from fedharness.problems.leaf import load_leaf

    write_leaf(tmp_path / "data", shakespeare(np.random.default_rng(4)))
    load_leaf(str(tmp_path / "data"), str(tmp_path / "cache"))  # cached first: the refusal then writes nothing
    for model in ("logreg", "linreg"):
        assert_refused(tmp_path, capsys, ["dataset=leaf", f"dataset.path={tmp_path / 'data'}", f"model={model}"],
                       "model", f"a model that reads int64 token ids (char_lstm, word_lstm, sent_lstm; model=auto "
                       f"picks the data's own on dataset=leaf/tff/hf): {model} would read the data's token ids")


def test_a_diverged_run_says_where_and_what_to_try(tmp_path, capsys):
    code = main(["run", "dataset=synthetic", "dataset.num_clients=4", "rounds=3", "eval_every=1", "progress=false",
                 "algorithm.clients_per_round=2", "algorithm.local_steps=2", "algorithm.client_lr=1e30",
                 "reference=off", f"results_dir={tmp_path / 'res'}"])
    captured = capsys.readouterr()
    rounds_done = int(pd.read_parquet(tmp_path / "res" / "runs").loc[0, "rounds_done"])
    assert code == 3 and "status=diverged" in captured.out
    assert captured.err.strip().splitlines() == [
        f"fedharness: run {captured.out.split('run ')[-1].split(':')[0]} diverged in round {rounds_done + 1} (the "
        "model or its loss was not finite); try a smaller algorithm.client_lr (now 1e+30; e.g. 1e+29), or a model "
        "that fits the data (model=auto picks the data's own)"]


def test_out_of_vocabulary_ids_of_tff_and_sent140_counted(tmp_path, caplog):
    from fedharness.problems.leaf import load_leaf
    from fedharness.problems.tff import CHARS, OOV, load_tff
    from federated_fakes import write_tff_shakespeare

    lines = {"train": {"ROMEO": ["O Romeo~ Romeo", "wherefore art thou"], "JULIET": ["a rose <by> any name"]},
             "test": {"ROMEO": ["that which we call"], "JULIET": ["would smell as sweet+"]}}
    write_tff_shakespeare(tmp_path / "t", lines)
    tweets = sent140(np.random.default_rng(5))
    write_leaf(tmp_path / "s", tweets)
    with caplog.at_level(logging.INFO, logger="fedharness"):
        tff = load_tff(str(tmp_path / "t"), str(tmp_path / "c"))
        leaf = load_leaf(str(tmp_path / "s"), str(tmp_path / "c"), vocab_size=5)  # 5 of the 8 words: some oov
    # TFF: every window (the 80 tokens before a target) after an outside character holds oov; that target is oov
    for split in ("train", "test"):
        windows = targets = samples = 0
        for line in (s for role in lines[split].values() for s in role):
            places = [i + 1 for i, c in enumerate(line) if c not in CHARS]  # token positions after bos
            samples += len(line) + 1  # each character and eos
            windows += sum(any(0 < p < t for p in places) for t in range(1, len(line) + 2))
            targets += len(places)
        assert tff.unknown[split] == {"samples": samples, "windows": windows, "targets": targets}
        assert int((np.asarray(tff.train.y if split == "train" else tff.test.y) == OOV).sum()) == targets
    # Sent140: the tweets with a word outside the vocabulary (the training split's 5 most frequent words)
    from collections import Counter

    train_words = Counter(w for _, (xs, _) in tweets["train"].items() for x in xs for w in x[4].split())
    vocab = {w for w, _ in train_words.most_common(5)}
    for split in ("train", "test"):
        texts = [x[4] for xs, _ in tweets[split].values() for x in xs]
        expected = sum(any(w not in vocab for w in t.split()) for t in texts)
        assert leaf.unknown[split] == {"samples": len(texts), "windows": expected, "targets": 0} and expected > 0
    assert "dataset=tff: a character outside TFF's CHARS is read as id 87; train: " in caplog.text
    assert "dataset=leaf: a word outside the vocabulary is read as id 1; train: " in caplog.text


def test_out_of_vocabulary_words_of_stackoverflow_counted(tmp_path):
    from fedharness.problems.tff import load_tff
    from federated_fakes import write_tff_stackoverflow

    sentences = {"train": {"u1": ["how to sort a list", "sort numpy arrays fast"], "u2": ["a list of lists"]},
                 "test": {"u1": ["how to print"], "u2": ["numpy sort"]}}
    write_tff_stackoverflow(tmp_path / "s", sentences, [("a", 9), ("to", 8), ("list", 7), ("sort", 6), ("how", 5)])
    data = load_tff(str(tmp_path / "s"), str(tmp_path / "c"), vocab_size=5)  # oov: 6
    vocab = {"a", "to", "list", "sort", "how"}
    for split, users in sentences.items():
        windows = targets = samples = 0
        for line in (s for lines in users.values() for s in lines):
            outside = [w not in vocab for w in line.split(" ")] + [False]  # each word, then eos
            samples += len(outside)
            targets += sum(outside)
            windows += sum(any(outside[:t]) for t in range(len(outside)))  # a window: the tokens before its target
        assert data.unknown[split] == {"samples": samples, "windows": windows, "targets": targets}
    assert data.unknown["id"] == 6 and data.unknown["what"] == "word outside the vocabulary"


@pytest.mark.slow  # a char LSTM trained on CPU
def test_hugging_face_text_with_unknown_characters_trains(tmp_path, capsys):
    _write_hf_text(tmp_path / "h", shakespeare(np.random.default_rng(6)))
    code = main(["run", "dataset=hf", f"dataset.path={tmp_path / 'h'}", "dataset.client_column=role",
                 f"dataset.cache_dir={tmp_path / 'c'}", f"results_dir={tmp_path / 'res'}", "progress=false",
                 "rounds=4", "eval_every=4", "algorithm.clients_per_round=3", "algorithm.local_steps=5",
                 "algorithm.batch_size=5", "threads=1"])
    captured = capsys.readouterr()
    assert code == 0 and "status=ok" in captured.out, captured
    assert "dataset=hf: a character outside LEAF's 80 letters is read as id 80; train: " in captured.err
    rounds = pd.read_parquet(tmp_path / "res" / "rounds").sort_values("round")
    first, last = rounds["test_loss"].iloc[0], rounds["test_loss"].iloc[-1]
    assert last < first and last < math.log(len(LETTERS) + 1), (first, last)
