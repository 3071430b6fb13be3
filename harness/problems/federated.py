"""Federated data sets read from files (dataset=leaf, tff, hf): natural clients, compact arrays, one cache.

A format's reader yields its samples in chunks (x, y, owners), x already compact: uint8 pixel codes (the
pixel is code * x_scale), uint8 token ids, or float32 where the values are not codes. `load_federated` writes
them once into a cache folder, grouped by client in sorted owner order (the per-client index), keyed by the
files' identity (path, size, mtime) and the reader's settings; every later load memory-maps that folder, so a
run reads only the pages it touches and set-up is a file open. Owners are int32 codes into the sorted names, in
the training and the test split alike (PooledData.owner, test_owner).

A text reader's meta may name its out-of-vocabulary id (`unknown_meta`): the cache's first write counts the
samples (windows) holding it, and the targets that are it, and says so in one log line; index.json keeps the count.
"""

from __future__ import annotations

import hashlib
import json
import os
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from fedharness.errors import ConfigError, require
from fedharness.keys import Key, integer, number, text
from fedharness.problems.pooled import PooledData

HOLDOUT_TAG = 36  # the data seed's generator for the hold-out: np.random.default_rng([seed, HOLDOUT_TAG])
CACHE_VERSION = 2  # bump when the cached layout changes: old folders are then never read (2: unknown ids counted)
PATH_KEY = "dataset.path"
WRITE_ROWS = 65536  # rows copied into the cache at a time: bounds the temporaries of the reordering
PIXEL_CODES = 255  # images stored as uint8 codes k, the pixel k / 255 (LEAF's and TFF's scaling)

Chunk = tuple[np.ndarray, np.ndarray, np.ndarray]  # x (compact), y int64, owner names (one per sample)
log = logging.getLogger(__name__)


def keys(what: str) -> dict[str, Key]:
    """The keys every federated file data set has, `what` saying what dataset.path holds."""
    return {
        "num_clients": integer("how many of the data's clients (partition=natural: drawn by the data seed; "
                               "another partition: the clients it makes)", lo=1,
                               null="every client the data has"),
        "path": text(what, null="required: where the data set is"),
        "cache_dir": text("where the per-client index (the compact arrays) is cached",
                          null="$XDG_CACHE_HOME/fedharness or ~/.cache/fedharness"),
        "holdout": number("data without a test split: this fraction of each owner's training samples (round(f n_k), "
                          "at most n_k - 1), drawn by the data seed, becomes that owner's test samples", lo=0, hi=1,
                          lo_open=True, hi_open=True, null="no hold-out"),
    }


@dataclass(frozen=True)
class Split:
    x: np.ndarray
    y: np.ndarray
    owner: np.ndarray  # int32 codes into FederatedData.names


@dataclass(frozen=True)
class FederatedData:
    names: list[str]  # the clients, sorted; owner codes index this list
    train: Split
    test: Split | None
    x_scale: float | None  # uint8 images: pixel = code * x_scale; None: x as stored (token ids, floats)
    num_classes: int | None
    folder: Path  # the cache folder read
    token_vocab: int | None = None  # token ids: how many ids the vocabulary has (PooledData.token_vocab)
    task: str | None = None  # the reader's name for what the samples are: image, text (characters), words
    unknown: dict[str, Any] | None = None  # text: the out-of-vocabulary id and the count_unknown of each split

    def pooled(self, model: str | None = None, holdout: float | None = None, seed: int = 0) -> PooledData:
        """The samples as a partitioner takes them; `model`: the model the data set's papers train on them
        (model=auto's choice); `holdout` (dataset.holdout): a fraction of each owner's training samples held out as
        its test samples (hold_out), for data without a test split."""
        train, test = self.train, self.test
        if holdout is not None:
            require(test is None, "dataset.holdout", holdout, "null: this data set has its own test split")
            train, test = hold_out(train, holdout, seed)
        return PooledData(train.x, train.y, None if test is None else test.x,
                          None if test is None else test.y, train.owner,
                          None if test is None else test.owner, self.num_classes, self.x_scale, self.token_vocab,
                          model, self.names)


def hold_out(split: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """(training, test): each owner's round(fraction * n_k) samples (at most n_k - 1: every owner keeps one to
    train on), drawn uniformly within the owner by `seed`, become its test samples; both keep the samples' order."""
    owner = split.owner.astype(np.int64)
    counts = np.bincount(owner)
    held = np.minimum(np.floor(fraction * counts + 0.5), np.maximum(counts - 1, 0)).astype(np.int64)
    order = np.lexsort((np.random.default_rng([seed, HOLDOUT_TAG]).random(len(owner)), owner))  # owner, shuffled
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.empty(len(owner), dtype=np.int64)
    rank[order] = np.arange(len(owner)) - starts[owner[order]]  # each sample's place in its owner's shuffle
    test = rank < held[owner]
    part = lambda keep: Split(split.x[keep], split.y[keep], split.owner[keep])  # noqa: E731
    return part(~test), part(test)


def require_path(path: str | None, what: str) -> Path:
    """dataset.path as a Path that exists, or one line saying what it must be."""
    require(path is not None and str(path) != "", PATH_KEY, path, f"required: {what}")
    found = Path(str(path)).expanduser()
    require(found.exists(), PATH_KEY, str(path), f"no such file or folder; expected {what}")
    return found


def bad_file(path: str | Path, file: Path | str, why: str) -> ConfigError:
    return ConfigError(PATH_KEY, str(path), f"{file}: {why}")


def pixel_codes(values: np.ndarray) -> np.ndarray | None:
    """uint8 codes k with k / 255 == values (to float32 rounding), or None where the values are not such codes."""
    codes = np.rint(np.asarray(values, dtype=np.float64) * PIXEL_CODES)
    if codes.size and (codes.min() < 0 or codes.max() > PIXEL_CODES):
        return None
    exact = np.abs(codes / PIXEL_CODES - values) <= 1e-6
    return codes.astype(np.uint8) if bool(np.all(exact)) else None


class NotCodes(Exception):
    """Pixels that are not k/255: the data set is read again with float32 pixels."""


def codes_or_floats(values: np.ndarray, codes: bool) -> np.ndarray:
    """Pixels as uint8 codes (`codes`; NotCodes where they are not k/255) or as float32."""
    if not codes:
        return np.asarray(values, dtype=np.float32)
    out = pixel_codes(values)
    if out is None:
        raise NotCodes()
    return out


def read_with_codes(read_all: Callable[[bool], Any]) -> tuple[Any, bool]:
    """read_all(codes=True), or read_all(codes=False) where some pixels are not codes; and which it was."""
    try:
        return read_all(True), True
    except NotCodes:
        return read_all(False), False


def image_shape(width: int) -> tuple[int, ...]:
    """A flat image's shape: a square of one channel (LEAF FEMNIST's 784 = 28 x 28), else the flat vector."""
    side = int(round(width ** 0.5))
    return (1, side, side) if side * side == width else (width,)


# --- the cache --------------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fedharness"


def files_identity(files: Iterable[Path]) -> list[tuple[str, int, int]]:
    """Each file's absolute path, size and modification time: a changed or replaced file is a new data set."""
    out = []
    for f in sorted(Path(p).resolve() for p in files):
        st = f.stat()
        out.append((str(f), st.st_size, st.st_mtime_ns))
    return out


def cache_folder(cache_dir: str | None, fmt: str, files: Iterable[Path], settings: dict[str, Any]) -> Path:
    identity = {"version": CACHE_VERSION, "format": fmt, "settings": settings, "files": files_identity(files)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / "federated" / f"{fmt}-{digest}"


def _grouped(chunks: Iterator[Chunk]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    parts = list(chunks)
    if not parts:
        return None
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([np.asarray(p[1], dtype=np.int64) for p in parts])
    owners = np.concatenate([np.asarray(p[2], dtype=str) for p in parts])
    return x, y, owners


def unknown_meta(unknown: tuple[int, str, bool] | None) -> dict[str, Any]:
    """A text reader's meta entry naming its out-of-vocabulary id: (the id, what it stands for, whether a target
    can be it: next-token tasks) or None (no such id: nothing is counted)."""
    if unknown is None:
        return {}
    token, what, in_targets = unknown
    return {"unknown": {"id": int(token), "what": what, "in_targets": bool(in_targets)}}


def count_unknown(x: np.ndarray, y: np.ndarray, unknown: dict[str, Any]) -> dict[str, int]:
    """Samples (windows) of one split holding the unknown id, and targets that are it (next-token tasks), read
    WRITE_ROWS at a time (x may be a memory map)."""
    token, windows = unknown["id"], 0
    for start in range(0, len(x), WRITE_ROWS):
        windows += int((x[start:start + WRITE_ROWS] == token).any(1).sum())  # x [n, length]: token ids
    targets = int((y == token).sum()) if unknown["in_targets"] else 0
    return {"samples": int(len(x)), "windows": windows, "targets": targets}


def unknown_note(fmt: str, unknown: dict[str, Any]) -> str:
    """The first load's line: how many windows (and targets) of each split hold the unknown id."""
    parts = []
    for split in ("train", "test"):
        if split in unknown:
            c = unknown[split]
            targets = f", {c['targets']:,} targets are one" if unknown["in_targets"] else ""
            parts.append(f"{split}: {c['windows']:,} of {c['samples']:,} windows hold one{targets}")
    return f"dataset={fmt}: a {unknown['what']} is read as id {unknown['id']}; " + "; ".join(parts)


def _write_split(folder: Path, split: str, x: np.ndarray, y: np.ndarray, codes: np.ndarray) -> dict[str, Any]:
    """Write one split grouped by owner code (a stable sort keeps each client's own sample order)."""
    order = np.argsort(codes, kind="stable")
    out = np.lib.format.open_memmap(folder / f"{split}_x.npy", mode="w+", dtype=x.dtype, shape=x.shape)
    for start in range(0, len(order), WRITE_ROWS):
        out[start:start + WRITE_ROWS] = x[order[start:start + WRITE_ROWS]]
    out.flush()
    del out
    np.save(folder / f"{split}_y.npy", y[order])
    np.save(folder / f"{split}_owner.npy", codes[order].astype(np.int32))
    return {"samples": int(len(y)), "clients": int(len(np.unique(codes)))}


def build_cache(folder: Path, train: Iterator[Chunk], test: Iterator[Chunk] | None,
                meta: dict[str, Any]) -> None:
    """Read the chunks and write the cache folder atomically (a temporary folder renamed into place)."""
    train_arrays = _grouped(train)
    test_arrays = None if test is None else _grouped(test)
    assert train_arrays is not None  # each reader refuses a data set without training samples
    names = np.unique(np.concatenate([train_arrays[2]] + ([] if test_arrays is None else [test_arrays[2]])))
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        unknown = meta.get("unknown")
        counts = {"train": _write_split(tmp, "train", train_arrays[0], train_arrays[1],
                                        np.searchsorted(names, train_arrays[2]))}
        if unknown is not None:
            unknown["train"] = count_unknown(train_arrays[0], train_arrays[1], unknown)
        del train_arrays
        if test_arrays is not None:
            counts["test"] = _write_split(tmp, "test", test_arrays[0], test_arrays[1],
                                          np.searchsorted(names, test_arrays[2]))
            if unknown is not None:
                unknown["test"] = count_unknown(test_arrays[0], test_arrays[1], unknown)
        (tmp / "index.json").write_text(json.dumps({**meta, "names": names.tolist(), "splits": counts}))
        os.replace(tmp, folder)
    except OSError:
        if not folder.exists():  # another process finished first: its folder is as good as ours
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_split(folder: Path, split: str) -> Split:
    # copy-on-write maps: torch takes them without a copy, and nothing is read before it is used
    return Split(np.load(folder / f"{split}_x.npy", mmap_mode="c"), np.load(folder / f"{split}_y.npy"),
                 np.load(folder / f"{split}_owner.npy"))


def read_cache(folder: Path) -> FederatedData:
    index = json.loads((folder / "index.json").read_text())
    test = _read_split(folder, "test") if "test" in index["splits"] else None
    return FederatedData(index["names"], _read_split(folder, "train"), test, index.get("x_scale"),
                         index.get("num_classes"), folder, index.get("token_vocab"), index.get("task"),
                         index.get("unknown"))


def load_federated(fmt: str, files: list[Path], settings: dict[str, Any], cache_dir: str | None,
                   read: Callable[[], tuple[Iterator[Chunk], Iterator[Chunk] | None, dict[str, Any]]]
                   ) -> FederatedData:
    """The data set of `files`, from the cache when its folder exists, else read by `read` (train chunks, test
    chunks or None, and the meta: x_scale, num_classes, token_vocab) and cached first."""
    folder = cache_folder(cache_dir, fmt, files, settings)
    if not (folder / "index.json").is_file():
        train, test, meta = read()
        build_cache(folder, train, test, meta)
        data = read_cache(folder)
        if data.unknown is not None:
            log.info(unknown_note(fmt, data.unknown))
        return data
    return read_cache(folder)


# --- which clients a run uses -----------------------------------------------------------------------------------


def select_owners(pooled: PooledData, count: int, seed: int) -> PooledData:
    """`count` of the data's owners drawn uniformly by `seed` (LEAF's client sampling), their samples only."""
    owners = np.unique(pooled.owner)
    require(count <= len(owners), "dataset.num_clients", count,
            f"at most the {len(owners)} clients the data has (null: all of them)")
    if count == len(owners):
        return pooled
    chosen = np.sort(np.random.default_rng(seed).choice(owners, count, replace=False))
    keep = np.isin(pooled.owner, chosen)
    test_keep = None if pooled.test_owner is None else np.isin(pooled.test_owner, chosen)
    test = (pooled.x_test, pooled.y_test, pooled.test_owner)
    if test_keep is not None:
        test = tuple(None if a is None else a[test_keep] for a in test)
    return PooledData(pooled.x[keep], pooled.y[keep], test[0], test[1], pooled.owner[keep], test[2],
                      pooled.num_classes, pooled.x_scale, pooled.token_vocab, pooled.model, pooled.owner_names)
