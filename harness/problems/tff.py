"""dataset=tff: TensorFlow Federated's HDF5 files (EMNIST-62, Shakespeare, StackOverflow), read with h5py, natural
clients.

Each file holds `examples/<client>/<feature>`, one group per client. dataset.path is a folder with one
`*train*.h5` and its `*test*.h5` (fed_emnist_train.h5 and fed_emnist_test.h5; shakespeare_train.h5 and
shakespeare_test.h5), or one file (a `*train*.h5` brings its test sibling). The task follows the features:

* `pixels` [n, 28, 28] and `label` (EMNIST): images 1 x 28 x 28, pixels that are k/255 kept as uint8 codes;
* `snippets` (Shakespeare: a role's lines as bytes): TFF's character ids (CHARS + 1, pad 0, oov 87, bos 88,
  eos 89: 90 tokens, tff.simulation.baselines.shakespeare), each snippet [bos, chars, eos]; every token after
  bos is a sample, predicted from the 80 before it (left-padded with pad), as LEAF's Shakespeare task;
* `tokens` (StackOverflow: sentences of space-separated words as bytes; stackoverflow_train.h5 and
  stackoverflow_test.h5, held_out unused): TFF's word ids (problems/words.py) from the word-count file
  dataset.vocab_path (null: stackoverflow.word_count next to the .h5), dataset.vocab_size words (TFF: 10,000)
  plus pad, oov, bos, eos; every token after bos is a sample predicted from the 20 before it, int32 ids.

The first load counts the windows holding the out-of-vocabulary id and the targets that are it. A folder without
a `*test*.h5` has no test split: a log line says so. model=auto is the model of TFF's baselines on the task
(MODELS): char_lstm, word_lstm, femnist_cnn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import logging

import numpy as np

from fedharness.base.extras import require_extra
from fedharness.errors import ConfigError
from fedharness.problems import federated
from fedharness.keys import integer, text
from fedharness.problems.federated import Chunk, FederatedData, bad_file, codes_or_floats
from fedharness.problems.words import next_token_samples, read_word_counts, stackoverflow_tokens
from fedharness.registry.groups import DATASETS

WHAT = "TensorFlow Federated's HDF5: a folder with *train*.h5 and *test*.h5 (examples/<client>/<feature>) or one .h5"
CHARS = 'dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#\'/37;?bfjnrvzBFJNRVZ"&*.26:\naeimquyAEIMQUY]!%)-159\r'
PAD, OOV, BOS, EOS = 0, len(CHARS) + 1, len(CHARS) + 2, len(CHARS) + 3
SEQUENCE = 80  # tokens a next-token sample sees, TFF's SEQUENCE_LENGTH
WORD_SEQUENCE = 20  # StackOverflow: words per sentence and tokens a sample sees (TFF's sequence_length)
WORD_COUNTS = "stackoverflow.word_count"  # TFF's word-count file, dataset.vocab_path's default beside the .h5
VOCAB_PATH_KEY = "dataset.vocab_path"
MODELS = {"text": "char_lstm", "words": "word_lstm", "image": "femnist_cnn"}  # TFF's baseline model of each task
log = logging.getLogger(__name__)
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
    rows = (np.concatenate([[BOS], _TOKEN[np.frombuffer(s if isinstance(s, bytes) else str(s).encode(),
                                                        dtype=np.uint8)], [EOS]]) for s in snippets)
    return next_token_samples(rows, SEQUENCE, PAD, np.uint8)


def _client(path: Path, file: Path, name: str, group: Any, codes: bool, vocab: "Vocab"
            ) -> tuple[np.ndarray, np.ndarray, str]:
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
    if "tokens" in features:
        words = vocab.words()
        rows = (stackoverflow_tokens(s, words, WORD_SEQUENCE) for s in np.asarray(group["tokens"][()]).reshape(-1))
        x, y = next_token_samples(rows, WORD_SEQUENCE, PAD, np.int32)
        return x, y, "words"
    raise bad_file(path, file, f"client {name!r} has features {sorted(features)}; expected EMNIST's pixels and "
                               "label, Shakespeare's snippets or StackOverflow's tokens")


class Vocab:
    """StackOverflow's vocabulary, read from the word-count file when a client first has tokens."""

    def __init__(self, file: Path, size: int):
        self.file, self.size, self._words = file, size, None

    def words(self) -> dict[str, int]:
        if self._words is None:
            self._words = read_word_counts(self.file, self.size, VOCAB_PATH_KEY)
        return self._words


def _chunks(h5py: Any, path: Path, file: Path, codes: bool, split: str, tasks: set[str], vocab: Vocab
            ) -> Iterator[Chunk]:
    try:
        handle = h5py.File(file, "r")
    except OSError as err:
        raise bad_file(path, file, f"not an HDF5 file ({err})") from None
    with handle:
        examples = handle.get("examples")
        if examples is None or not hasattr(examples, "keys"):
            raise bad_file(path, file, "no examples/ group: expected examples/<client>/<feature>")
        for name in sorted(examples.keys()):
            x, y, task = _client(path, file, name, examples[name], codes, vocab)
            tasks.add(task)
            if not len(y):
                if split == "train":
                    raise bad_file(path, file, f"client {name!r} has no training samples; every client needs at "
                                               "least one")
                continue
            yield x, y, np.full(len(y), name)


def load_tff(path: str | None, cache_dir: str | None = None, vocab_path: str | None = None,
             vocab_size: int = 10_000) -> FederatedData:
    """The TFF data set at `path`, from the cache after its first read; StackOverflow's vocabulary: the first
    `vocab_size` words of the word-count file `vocab_path` (None: stackoverflow.word_count beside the .h5)."""
    root = federated.require_path(path, WHAT)
    train, test = tff_files(root)
    h5py = require_extra("h5py", "dataset", "tff")
    counts = train.with_name(WORD_COUNTS) if vocab_path is None else Path(vocab_path).expanduser()
    if vocab_path is not None and not counts.is_file():
        read_word_counts(counts, vocab_size, VOCAB_PATH_KEY)  # the one-line error, before any reading
    vocab = Vocab(counts, vocab_size)

    def read_all(codes: bool) -> tuple[list[Chunk], list[Chunk] | None, set[str]]:
        tasks: set[str] = set()
        chunks = list(_chunks(h5py, root, train, codes, "train", tasks, vocab))
        if not chunks:
            raise bad_file(root, train, "no clients under examples/")
        test_chunks = None if test is None else list(_chunks(h5py, root, test, codes, "test", tasks, vocab))
        if len(tasks) > 1:
            raise bad_file(root, train, f"clients mix features of several tasks ({', '.join(sorted(tasks))})")
        return chunks, test_chunks, tasks

    def read():
        (chunks, test_chunks, tasks), codes = federated.read_with_codes(read_all)
        if test is None:  # said once the files are read (a bad file's error is then the only line)
            log.info(f"dataset=tff: no test file beside {train.name} (no *test*.h5): no test split, so no test_* "
                     "or per-client metrics")
        task = tasks.pop()
        classes = {"text": EOS + 1, "words": vocab_size + 4, "image": None}[task]  # words: + pad, oov, bos, eos
        unknown = {"text": (OOV, "character outside TFF's CHARS", True),
                   "words": (vocab_size + 1, "word outside the vocabulary", True)}.get(task)
        meta = {"task": task, "num_classes": classes, "token_vocab": classes,
                "x_scale": 1.0 / federated.PIXEL_CODES if codes and task == "image" else None,
                **federated.unknown_meta(unknown)}
        return iter(chunks), None if test_chunks is None else iter(test_chunks), meta

    # the word counts are part of the data's identity where they exist (a new file: a new vocabulary)
    files = [train] + ([] if test is None else [test]) + ([counts] if counts.is_file() else [])
    return federated.load_federated("tff", files, {"vocab_size": vocab_size}, cache_dir, read)


def tff_dataset(path: str | None = None, cache_dir: str | None = None, vocab_path: str | None = None,
                vocab_size: int = 10_000, holdout: float | None = None, seed: int = 0):
    """dataset=tff: the pooled samples with each one's owner (a writer, a speaking role, a StackOverflow user)."""
    data = load_tff(path, cache_dir, vocab_path, vocab_size)
    return data.pooled(MODELS[data.task], holdout, seed)


DATASETS.add("tff", tff_dataset, {
    **federated.keys(WHAT),
    "vocab_path": text("StackOverflow: TFF's word-count file (lines \"word count\", most frequent first)",
                       null="stackoverflow.word_count next to the .h5"),
    "vocab_size": integer("StackOverflow: the words of the vocabulary, the word-count file's first (TFF: 10,000); "
                          "model=word_lstm then has vocab_size + 4 outputs (pad, oov, bos, eos)", lo=1)})
