"""Word-level text of the federated benchmarks: vocabularies, word ids, next-token windows.

* TFF's StackOverflow (tff.simulation.baselines.stackoverflow): the vocabulary is the first `size` words of
  TFF's word-count file (lines "word count", most frequent first); ids pad 0, the words 1..size, oov size + 1,
  bos size + 2, eos size + 3. A sentence's first `length` words become [bos, ids..., eos] (eos only where the
  sentence was not cut), as TFF's word prediction preprocessing does.
* LEAF's Sent140: words as LEAF's language_utils.split_line finds them; the vocabulary is the training split's
  `size` most frequent words (ties: first seen first); ids pad 0, oov 1, the words 2..size + 1; a tweet's first
  `length` words, padded with pad after them.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Iterable

import numpy as np

from fedharness.errors import ConfigError

LEAF_WORD = re.compile(r"[\w']+|[.,!?;]")  # LEAF's language_utils.split_line
OOV = 1  # Sent140: the id of a word outside the vocabulary (0: pad)


def next_token_samples(rows: Iterable[np.ndarray], length: int, pad: int, dtype: type
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Every token after a row's first is a sample: x the `length` tokens before it (left-padded with `pad`),
    y the token; x [n, length] of `dtype`, y [n] int64."""
    xs, ys = [], []
    for tokens in rows:
        padded = np.concatenate([np.full(length, pad, dtype=dtype), np.asarray(tokens, dtype=dtype)])
        xs.append(np.lib.stride_tricks.sliding_window_view(padded, length)[1:len(tokens)])
        ys.append(np.asarray(tokens[1:], dtype=np.int64))
    if not xs:
        return np.empty((0, length), dtype), np.empty(0, np.int64)
    return np.concatenate(xs), np.concatenate(ys)


def read_word_counts(file: Path, size: int, key: str) -> dict[str, int]:
    """The first `size` words of a TFF word-count file as {word: id}, ids 1..size (ConfigError naming `key`)."""
    if not file.is_file():
        raise ConfigError(key, str(file), "no such file: TFF's stackoverflow.word_count (lines \"word count\", most "
                                          "frequent first); null: the file next to the .h5")
    vocab: dict[str, int] = {}
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if len(vocab) == size:
                break
            fields = line.split()
            if len(fields) != 2 or not fields[1].isdigit():
                raise ConfigError(key, str(file), f"line {number} is {line.strip()[:60]!r}: expected \"word count\"")
            vocab.setdefault(fields[0], len(vocab) + 1)
    return vocab


def stackoverflow_tokens(sentence: bytes | str, vocab: dict[str, int], length: int) -> np.ndarray:
    """[bos, word ids..., eos] of one sentence (TFF: split on ' ', the first `length` words, eos if not cut)."""
    size = len(vocab)
    oov, bos, eos = size + 1, size + 2, size + 3
    text = sentence.decode("utf-8") if isinstance(sentence, bytes) else str(sentence)
    words = text.split(" ")[:length]
    ids = [bos, *(vocab.get(w, oov) for w in words)]
    return np.asarray(ids + [eos] if len(words) < length else ids, dtype=np.int64)


def leaf_vocabulary(texts: Iterable[str], size: int) -> dict[str, int]:
    """The `size` most frequent words of `texts` as {word: id}, ids 2..size + 1 (0 pad, 1 oov)."""
    counts = Counter(w for t in texts for w in LEAF_WORD.findall(t))
    return {w: i + 2 for i, (w, _) in enumerate(counts.most_common(size))}


def leaf_word_ids(texts: list[str], vocab: dict[str, int], length: int) -> np.ndarray:
    """[n, length] int32 word ids of tweets: the first `length` words (oov 1), padded with 0 after them."""
    out = np.zeros((len(texts), length), dtype=np.int32)
    for row, t in enumerate(texts):
        ids = [vocab.get(w, OOV) for w in LEAF_WORD.findall(t)[:length]]
        out[row, :len(ids)] = ids
    return out
