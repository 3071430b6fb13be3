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
