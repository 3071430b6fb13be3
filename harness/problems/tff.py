"""dataset=tff: TensorFlow Federated's HDF5 files (EMNIST-62, Shakespeare), read with h5py, natural clients.

Each file holds `examples/<client>/<feature>`, one group per client. dataset.path is a folder with one
`*train*.h5` and its `*test*.h5` (fed_emnist_train.h5 and fed_emnist_test.h5; shakespeare_train.h5 and
shakespeare_test.h5), or one file (a `*train*.h5` brings its test sibling). The task follows the features:

* `pixels` [n, 28, 28] and `label` (EMNIST): images 1 x 28 x 28, pixels that are k/255 kept as uint8 codes;
* `snippets` (Shakespeare: a role's lines as bytes): TFF's character ids (CHARS + 1, pad 0, oov 87, bos 88,
  eos 89: 90 tokens, tff.simulation.baselines.shakespeare), each snippet [bos, chars, eos]; every token after
  bos is a sample, predicted from the 80 before it (left-padded with pad), as LEAF's Shakespeare task.

StackOverflow's `tokens` need TFF's word-count file for their vocabulary and are refused with a message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fedharness.base.extras import require_extra
from fedharness.errors import ConfigError
from fedharness.problems import federated
from fedharness.problems.federated import Chunk, FederatedData, bad_file, codes_or_floats
from fedharness.registry.groups import DATASETS

WHAT = "TensorFlow Federated's HDF5: a folder with *train*.h5 and *test*.h5 (examples/<client>/<feature>) or one .h5"
CHARS = 'dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]!%)-159\r'
PAD, OOV, BOS, EOS = 0, len(CHARS) + 1, len(CHARS) + 2, len(CHARS) + 3
SEQUENCE = 80  # tokens a next-token sample sees, TFF's SEQUENCE_LENGTH
_TOKEN = np.full(256, OOV, dtype=np.uint8)
_TOKEN[np.frombuffer(CHARS.encode("ascii"), dtype=np.uint8)] = np.arange(1, len(CHARS) + 1)


def tff_files(root: Path) -> tuple[Path, Path | None]:
    """The training file and its test file (None: none) under dataset.path."""
    if root.is_file():
        test = root.with_name(root.name.replace("train", "test"))
        return root, test if "train" in root.name and test.is_file() else None
    train = sorted(root.glob("*train*.h5"))
    if len(train) != 1:
        found = ", ".join(p.name for p in train) or "none"
        raise ConfigError(federated.PATH_KEY, str(root), f"one *train*.h5 in the folder (found: {found}); "
                                                         f"or name the file; expected {WHAT}")
    test = train[0].with_name(train[0].name.replace("train", "test"))
    return train[0], test if test.is_file() else None


def snippet_samples(snippets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Next-token samples of a client's snippets: x [n, 80] uint8 token ids, y [n] int64."""
    xs, ys = [], []
    for snippet in snippets:
        raw = np.frombuffer(snippet if isinstance(snippet, bytes) else str(snippet).encode(), dtype=np.uint8)
        tokens = np.concatenate([[BOS], _TOKEN[raw], [EOS]]).astype(np.uint8)
        padded = np.concatenate([np.full(SEQUENCE, PAD, dtype=np.uint8), tokens])
        xs.append(np.lib.stride_tricks.sliding_window_view(padded, SEQUENCE)[1:len(tokens)])
        ys.append(tokens[1:].astype(np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def _client(path: Path, file: Path, name: str, group: Any, codes: bool) -> tuple[np.ndarray, np.ndarray, str]:
    features = set(group.keys())
    if {"pixels", "label"} <= features:
        pixels, label = np.asarray(group["pixels"][()]), np.asarray(group["label"][()])
        if pixels.ndim != 3 or label.ndim != 1 or len(pixels) != len(label):
            raise bad_file(path, file, f"client {name!r}: pixels {pixels.shape} and label {label.shape}, expected "
                                       "[n, height, width] and [n]")
        if not len(label):
            return pixels[:, None], label.astype(np.int64), "image"
        if not np.issubdtype(label.dtype, np.integer) or label.min() < 0:
            raise bad_file(path, file, f"client {name!r}: labels must be integer classes >= 0")
        return codes_or_floats(pixels, codes)[:, None], label.astype(np.int64), "image"
    if "snippets" in features:
        snippets = np.asarray(group["snippets"][()]).reshape(-1)
        if not len(snippets):
            return np.empty((0, SEQUENCE), np.uint8), np.empty(0, np.int64), "text"
        x, y = snippet_samples(snippets)
        return x, y, "text"
    hint = " (StackOverflow's tokens need TFF's word counts for a vocabulary: not read yet)" \
        if "tokens" in features else ""
    raise bad_file(path, file, f"client {name!r} has features {sorted(features)}; expected EMNIST's pixels and "
                               f"label or Shakespeare's snippets{hint}")


def _chunks(h5py: Any, path: Path, file: Path, codes: bool, split: str, tasks: set[str]) -> Iterator[Chunk]:
    try:
        handle = h5py.File(file, "r")
    except OSError as err:
        raise bad_file(path, file, f"not an HDF5 file ({err})") from None
    with handle:
        examples = handle.get("examples")
        if examples is None or not hasattr(examples, "keys"):
            raise bad_file(path, file, "no examples/ group: expected examples/<client>/<feature>")
        for name in sorted(examples.keys()):
            x, y, task = _client(path, file, name, examples[name], codes)
            tasks.add(task)
            if not len(y):
                if split == "train":
                    raise bad_file(path, file, f"client {name!r} has no training samples; every client needs at "
                                               "least one")
                continue
            yield x, y, np.full(len(y), name)


def load_tff(path: str | None, cache_dir: str | None = None) -> FederatedData:
    """The TFF data set at `path`, from the cache after its first read."""
    root = federated.require_path(path, WHAT)
    train, test = tff_files(root)
    h5py = require_extra("h5py", "dataset", "tff")

    def read_all(codes: bool) -> tuple[list[Chunk], list[Chunk] | None, set[str]]:
        tasks: set[str] = set()
        chunks = list(_chunks(h5py, root, train, codes, "train", tasks))
        if not chunks:
            raise bad_file(root, train, "no clients under examples/")
        test_chunks = None if test is None else list(_chunks(h5py, root, test, codes, "test", tasks))
        if len(tasks) > 1:
            raise bad_file(root, train, "clients mix image and text features")
        return chunks, test_chunks, tasks

    def read():
        (chunks, test_chunks, tasks), codes = federated.read_with_codes(read_all)
        text = tasks == {"text"}
        meta = {"task": "text" if text else "image", "num_classes": EOS + 1 if text else None,
                "x_scale": 1.0 / federated.PIXEL_CODES if codes and not text else None}
        return iter(chunks), None if test_chunks is None else iter(test_chunks), meta

    return federated.load_federated("tff", [train] + ([] if test is None else [test]), {}, cache_dir, read)


def tff_dataset(path: str | None = None, cache_dir: str | None = None):
    """dataset=tff: the pooled samples with each one's owner (a writer, a speaking role)."""
    return load_tff(path, cache_dir).pooled()


DATASETS.add("tff", tff_dataset, federated.keys(WHAT))
