"""Small federated data sets written in their real on-disk formats: LEAF JSON, TFF HDF5, Hugging Face."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fedharness.problems.leaf import LETTERS

Samples = dict[str, dict[str, tuple[list, list]]]  # split -> user -> (xs, ys), as written


def leaf_images(rng: np.random.Generator, users: list[str], codes: bool = True, classes: int = 62) -> Samples:
    """FEMNIST-like samples: 784 pixels (LEAF's 1 - p/255, or arbitrary floats), a class each, 90/10 per user."""
    out: Samples = {"train": {}, "test": {}}
    for u in users:
        n = int(rng.integers(3, 9))
        pixels = (1 - rng.integers(0, 256, (n, 784)) / 255) if codes else rng.normal(size=(n, 784))
        labels = rng.integers(0, classes, n)
        out["train"][u] = (pixels[:-1].tolist(), labels[:-1].tolist())
        out["test"][u] = (pixels[-1:].tolist(), labels[-1:].tolist())
    return out


def leaf_text(rng: np.random.Generator, users: list[str]) -> Samples:
    """Shakespeare-like samples: 80 letters and the next one, 90/10 per user."""
    out: Samples = {"train": {}, "test": {}}
    for u in users:
        n = int(rng.integers(3, 7))
        text = "".join(rng.choice(list(LETTERS), n + 80))
        xs, ys = [text[i:i + 80] for i in range(n)], [text[i + 80] for i in range(n)]
        out["train"][u], out["test"][u] = (xs[:-1], ys[:-1]), (xs[-1:], ys[-1:])
    return out


def write_leaf(root: Path, samples: Samples, per_file: int = 2) -> None:
    """LEAF's layout: train/ and test/ of all_data_<i>_..._niid_0_keep_0_<split>_9.json, `per_file` users each."""
    for split, users in samples.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        names = list(users)
        for i in range(0, len(names), per_file):
            part = names[i:i + per_file]
            doc = {"users": part, "num_samples": [len(users[u][0]) for u in part],
                   "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in part}}
            (root / split / f"all_data_{i // per_file}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(doc))


def write_tff_emnist(folder: Path, rng: np.random.Generator, clients: list[str]) -> dict[str, dict]:
    """fed_emnist_{train,test}.h5: examples/<client>/pixels [n, 28, 28] float32 in [0, 1], label [n] int32."""
    import h5py

    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, dict] = {"train": {}, "test": {}}
    for split in ("train", "test"):
        with h5py.File(folder / f"fed_emnist_{split}.h5", "w") as f:
            for c in clients:
                n = int(rng.integers(2, 6))
                pixels = (rng.integers(0, 256, (n, 28, 28)) / 255).astype(np.float32)
                label = rng.integers(0, 62, n).astype(np.int32)
                f.create_dataset(f"examples/{c}/pixels", data=pixels)
                f.create_dataset(f"examples/{c}/label", data=label)
                written[split][c] = (pixels, label)
    return written


def write_tff_shakespeare(folder: Path, snippets: dict[str, dict[str, list[str]]]) -> None:
    """shakespeare_{train,test}.h5: examples/<role>/snippets, variable-length byte strings."""
    import h5py

    folder.mkdir(parents=True, exist_ok=True)
    for split, roles in snippets.items():
        with h5py.File(folder / f"shakespeare_{split}.h5", "w") as f:
            for role, lines in roles.items():
                f.create_dataset(f"examples/{role}/snippets", data=np.array([s.encode() for s in lines], dtype=object),
                                 dtype=h5py.string_dtype(encoding="utf-8"))


def leaf_sent140(rng: np.random.Generator, users: list[str], words: list[str]) -> Samples:
    """Sent140-like samples: [tweet_id, date, query, user, text] and a sentiment 0 or 1, 3 to 5 train and 1 test
    tweet per user, of 1 to 30 words (some over LEAF's 25), punctuation its own word."""
    out: Samples = {"train": {}, "test": {}}
    tweet_id = 1467810369
    for u in users:
        records, labels = [], []
        for _ in range(int(rng.integers(4, 7))):
            text = " ".join(rng.choice(words, int(rng.integers(1, 31))))
            records.append([str(tweet_id), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", u, text])
            labels.append(int(rng.integers(0, 2)))
            tweet_id += 1
        out["train"][u], out["test"][u] = (records[:-1], labels[:-1]), (records[-1:], labels[-1:])
    return out


def write_tff_stackoverflow(folder: Path, sentences: dict[str, dict[str, list[str]]],
                            word_counts: list[tuple[str, int]]) -> None:
    """stackoverflow_{train,test}.h5 (examples/<user>/tokens, title, tags, score, creation_date, type, as TFF's)
    and stackoverflow.word_count ("word count" lines, most frequent first) beside them."""
    import h5py

    folder.mkdir(parents=True, exist_ok=True)
    strings = h5py.string_dtype(encoding="utf-8")
    for split, users in sentences.items():
        with h5py.File(folder / f"stackoverflow_{split}.h5", "w") as f:
            for user, lines in users.items():
                n = len(lines)
                group = f.create_group(f"examples/{user}")
                group.create_dataset("tokens", data=np.array([s.encode() for s in lines], dtype=object), dtype=strings)
                group.create_dataset("title", data=np.array([b"a title"] * n, dtype=object), dtype=strings)
                group.create_dataset("tags", data=np.array([b"python|numpy"] * n, dtype=object), dtype=strings)
                group.create_dataset("type", data=np.array([b"question"] * n, dtype=object), dtype=strings)
                group.create_dataset("creation_date", data=np.array([b"2010-01-08 09:34:05.0"] * n, dtype=object),
                                     dtype=strings)
                group.create_dataset("score", data=np.arange(n, dtype=np.int64))
    (folder / "stackoverflow.word_count").write_text("".join(f"{w} {c}\n" for w, c in word_counts))


def assert_refused(tmp_path: Path, capsys, overrides: list[str], key: str, expected: str) -> None:
    """`fedharness run` with `overrides` exits 2 with one line naming `key` and saying `expected`, and writes
    nothing under tmp_path (no results, no cache)."""
    from fedharness.cli import main

    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code = main(["run", f"results_dir={tmp_path / 'res'}", f"dataset.cache_dir={tmp_path / 'cache'}",
                 "progress=false", *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"fedharness: error: invalid value for '{key}': ") and expected in err[0], err[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no results, no cache
