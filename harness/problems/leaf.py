"""dataset=leaf: LEAF's JSON (FEMNIST, Shakespeare, Sent140, any image task stored as arrays), natural clients.

dataset.path is what LEAF's preprocess.sh leaves in data/<task>/data: train/ and test/ folders of JSON files,
each {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}; a folder of JSON
files alone (all_data/) or one JSON file is read as training data without a test split. The task is inferred
from the samples:

* image: each x a list of numbers (FEMNIST: 784 pixels in [0, 1], written as 1 x 28 x 28), y an integer class;
  pixels that are k/255 are kept as uint8 codes, any other values as float32;
* text (Shakespeare): each x a string of 80 characters, y the next character, both as ids in LEAF's 80-letter
  vocabulary (LETTERS, LEAF's language_utils.ALL_LETTERS) and one unknown id, UNKNOWN = 80, for every other
  character (LEAF's preprocessing keeps the Gutenberg text whole: `_`, `{`, `@`, ...; a target that is unknown
  is class 80), so num_classes = token_vocab = 81; the first load counts the windows and targets that hold it;
* words (Sent140): each x a tweet's [id, date, query, user, text], y its sentiment 0 or 1; the text's first 25
  words (LEAF's max_words) as int32 ids in the training split's dataset.vocab_size most frequent words
  (problems/words.py: pad 0, oov 1), padded after the words; num_classes = 2 (model=sent_lstm); the first load
  counts the tweets with an oov word.

model=auto is the model LEAF trains on the task (MODELS): char_lstm, sent_lstm, femnist_cnn.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Iterator

import numpy as np

from fedharness.errors import ConfigError
from fedharness.problems import federated
from fedharness.keys import integer
from fedharness.problems.federated import Chunk, FederatedData, bad_file, codes_or_floats
from fedharness.problems.words import OOV, leaf_vocabulary, leaf_word_ids
from fedharness.registry.groups import DATASETS

try:  # the `federated` extra: LEAF's JSON parsed over 3x faster, into the same lists and floats
    from orjson import loads as parse_json
except ImportError:
    from json import loads as parse_json

LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
TWEET_WORDS = 25  # Sent140: the words of a tweet read (LEAF's sent140 max_words)
WHAT = "a LEAF data folder (train/ and test/ of JSON files, as LEAF's preprocess.sh writes them) or one JSON file"
UNKNOWN = len(LETTERS)  # every character outside LETTERS (LEAF's models: ALL_LETTERS.find(c), which gives -1)
LETTER_VOCAB = len(LETTERS) + 1  # the ids of text: the 80 letters and UNKNOWN (an embedding's rows, the classes)
MODELS = {"text": "char_lstm", "words": "sent_lstm", "image": "femnist_cnn"}  # LEAF's model of each task
_LETTER_ID = np.full(256, UNKNOWN, dtype=np.uint8)  # by code point; 255 stands for every code point above it
_LETTER_ID[np.frombuffer(LETTERS.encode("ascii"), dtype=np.uint8)] = np.arange(len(LETTERS))


def leaf_files(root: Path) -> tuple[list[Path], list[Path]]:
    """The training and test JSON files under dataset.path."""
    if root.is_file():
        return [root], []
    if (root / "train").is_dir():
        train, test = sorted((root / "train").glob("*.json")), sorted((root / "test").glob("*.json"))
    else:
        train, test = sorted(root.glob("*.json")), []
    if not train:
        raise ConfigError(federated.PATH_KEY, str(root), f"no JSON files: expected {WHAT}")
    return train, test


def _read_json(path: Path, file: Path) -> dict:
    try:
        data = parse_json(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise bad_file(path, file, f"not JSON ({err})") from None
    if not (isinstance(data, dict) and isinstance(data.get("users"), list)
            and isinstance(data.get("user_data"), dict)):
        raise bad_file(path, file, "expected LEAF JSON: an object with users, num_samples and "
                                   "user_data {user: {x, y}}")
    return data


def letter_ids(values: list) -> np.ndarray:
    """LEAF letter ids of equally long strings, [n, length] uint8, UNKNOWN for a character outside the 80 letters
    (ValueError where the values are not strings of one length)."""
    if not all(isinstance(v, str) for v in values) or len({len(v) for v in values}) > 1:
        raise ValueError("must be strings of one length (Shakespeare: 80)")
    points = np.frombuffer("".join(values).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return _LETTER_ID[np.minimum(points, 255)].reshape(len(values), -1)


def _text(path: Path, file: Path, user: str, values: list, what: str) -> np.ndarray:
    try:
        return letter_ids(values)
    except ValueError as err:
        raise bad_file(path, file, f"user {user!r}: each {what} {err}") from None


def _image(path: Path, file: Path, user: str, xs: list, ys: list, codes: bool) -> tuple[np.ndarray, np.ndarray]:
    try:
        x = np.asarray(xs, dtype=np.float64)
        y = np.asarray(ys, dtype=np.float64)
    except (ValueError, TypeError):
        raise bad_file(path, file, f"user {user!r}: each x must be a list of numbers of one length and each y "
                                   "an integer class") from None
    if x.ndim != 2 or y.ndim != 1 or not np.all(np.isfinite(x)) or (y != np.rint(y)).any() or (y < 0).any():
        raise bad_file(path, file, f"user {user!r}: each x must be a list of finite numbers of one length and "
                                   "each y an integer class >= 0")
    shape = (len(x), *federated.image_shape(x.shape[1]))
    return codes_or_floats(x, codes).reshape(shape), y.astype(np.int64)


def _task(xs: list) -> str:
    first = xs[0]
    if isinstance(first, str):
        return "text"
    if isinstance(first, list) and first and isinstance(first[-1], str):
        return "words"
    return "image"


def tweet_texts(path: Path, file: Path, user: str, xs: list) -> list[str]:
    """The text of each Sent140 record [id, date, query, user, text] (a one-line error naming the record)."""
    for i, x in enumerate(xs):
        if not (isinstance(x, list) and len(x) == 5 and isinstance(x[4], str)):
            raise bad_file(path, file, f"user {user!r}: x[{i}] is {reprlib.repr(x)}: expected Sent140's [tweet_id, "
                                       "date, query, user, text]")
    return [x[4] for x in xs]


def _labels(path: Path, file: Path, user: str, ys: list) -> np.ndarray:
    if not all(type(v) is int and v in (0, 1) for v in ys):
        bad = next(v for v in ys if not (type(v) is int and v in (0, 1)))
        raise bad_file(path, file, f"user {user!r}: y {bad!r}: expected Sent140's sentiment 0 or 1")
    return np.asarray(ys, dtype=np.int64)


def _users(path: Path, files: list[Path]) -> Iterator[tuple[Path, str, list, list]]:
    """Each user's (file, name, xs, ys), one file parsed at a time."""
    for file in files:
        data = _read_json(path, file)
        counts = data.get("num_samples")
        for i, user in enumerate(data["users"]):
            entry = data["user_data"].get(user)
            if not (isinstance(entry, dict) and isinstance(entry.get("x"), list) and isinstance(entry.get("y"), list)):
                raise bad_file(path, file, f"user {user!r} has no user_data entry with x and y lists")
            xs, ys = entry["x"], entry["y"]
            if len(xs) != len(ys) or (isinstance(counts, list) and i < len(counts) and counts[i] != len(xs)):
                raise bad_file(path, file, f"user {user!r}: {len(xs)} x, {len(ys)} y, num_samples says "
                                           f"{counts[i] if isinstance(counts, list) and i < len(counts) else '?'}")
            yield file, str(user), xs, ys
        del data


def sent140_vocabulary(path: Path, files: list[Path], size: int) -> dict[str, int] | None:
    """The training split's vocabulary where it is Sent140 (its first sample a tweet record), else None."""
    texts: list[str] = []
    for file, user, xs, _ in _users(path, files):
        if xs and _task(xs) != "words":
            return None
        texts += tweet_texts(path, file, user, xs)
    return leaf_vocabulary(texts, size)


def _user_chunks(path: Path, files: list[Path], codes: bool, split: str, tasks: set[str],
                 vocab: dict[str, int] | None) -> Iterator[Chunk]:
    """One chunk per user, one file parsed at a time; `tasks` gathers the tasks seen (image, text, words)."""
    for file, user, xs, ys in _users(path, files):
        if not xs:
            if split == "train":
                raise bad_file(path, file, f"user {user!r} has no training samples; every client needs at least one")
            continue
        tasks.add(_task(xs))
        if len(tasks) > 1:
            raise bad_file(path, file, f"user {user!r}: tasks mixed in one data set ({', '.join(sorted(tasks))})")
        if "words" in tasks:
            texts = tweet_texts(path, file, user, xs)
            assert vocab is not None  # tweets in the training split: a vocabulary (a test split alone: mixed)
            x, y = leaf_word_ids(texts, vocab, TWEET_WORDS), _labels(path, file, user, ys)
        elif "text" in tasks:
            x, y = _text(path, file, user, xs, "x"), _text(path, file, user, ys, "y")
            if y.shape[1] != 1:
                raise bad_file(path, file, f"user {user!r}: each y must be the one next character")
            y = y[:, 0].astype(np.int64)
        else:
            x, y = _image(path, file, user, xs, ys, codes)
        yield x, y, np.full(len(y), user)


def _read_all(root: Path, train: list[Path], test: list[Path], codes: bool, vocab: dict[str, int] | None
              ) -> tuple[list[Chunk], list[Chunk] | None, set[str]]:
    tasks: set[str] = set()
    chunks = list(_user_chunks(root, train, codes, "train", tasks, vocab))
    return chunks, list(_user_chunks(root, test, codes, "test", tasks, vocab)) if test else None, tasks


def load_leaf(path: str | None, cache_dir: str | None = None, vocab_size: int = 10_000) -> FederatedData:
    """The LEAF data set at `path`, from the cache after its first read; Sent140's vocabulary: the training
    split's `vocab_size` most frequent words."""
    root = federated.require_path(path, WHAT)
    train, test = leaf_files(root)

    def read():
        vocab = sent140_vocabulary(root, train, vocab_size)
        # pixels as uint8 codes where every value is k/255 (LEAF's FEMNIST), else float32
        (chunks, test_chunks, tasks), codes = federated.read_with_codes(
            lambda codes: _read_all(root, train, test, codes, vocab))
        task = tasks.pop()
        meta = {"task": task, "num_classes": {"text": LETTER_VOCAB, "words": 2, "image": None}[task],
                "token_vocab": {"text": LETTER_VOCAB, "words": vocab_size + 2, "image": None}[task],  # + pad, oov
                "x_scale": 1.0 / federated.PIXEL_CODES if codes and task == "image" else None,
                **federated.unknown_meta({"text": (UNKNOWN, "character outside LEAF's 80 letters", True),
                                          "words": (OOV, "word outside the vocabulary", False)}.get(task))}
        return iter(chunks), None if test_chunks is None else iter(test_chunks), meta

    return federated.load_federated("leaf", train + test, {"vocab_size": vocab_size}, cache_dir, read)


def leaf_dataset(path: str | None = None, cache_dir: str | None = None, vocab_size: int = 10_000,
                 holdout: float | None = None, seed: int = 0):
    """dataset=leaf: the pooled samples with each one's owner (a writer, a speaking role, a Twitter user)."""
    data = load_leaf(path, cache_dir, vocab_size)
    return data.pooled(MODELS[data.task], holdout, seed)


DATASETS.add("leaf", leaf_dataset, {
    **federated.keys(WHAT),
    "vocab_size": integer("Sent140: the words of the vocabulary, the training split's most frequent; "
                          "model=sent_lstm's embedding has these and pad, oov", lo=1)})
