"""dataset=hf: a Hugging Face data set whose `dataset.client_column` names each sample's owner, natural clients.

dataset.path is a folder `datasets.Dataset.save_to_disk` (or DatasetDict's) wrote, a Parquet file or a folder of
them (files named test* are the test split, as the Hub names them), or a Hub id (`flwrlabs/femnist`,
`flwrlabs/shakespeare`) where the network allows. Arrow is read one record batch at a time, memory-mapped, never
copied whole into memory. The columns:

* `x_column` (null: image, img, pixels or x): an Image (PNG bytes, decoded with Pillow: uint8 codes, pixel =
  code/255), numbers (a flat list is an image where its length is a square), or strings of one length, which
  are LEAF's 80 letters (flwrlabs/shakespeare), any other character LEAF's reader's unknown id (80; counted at
  the first load, problems/leaf.py);
* `y_column` (null: label, character or y): integer classes, or one character (its LEAF letter id, or 80).

model=auto is the model LEAF trains on such data (MODELS): char_lstm for text, femnist_cnn for images.
"""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from fedharness.base.extras import require_extra
from fedharness.errors import ConfigError, require
from fedharness.keys import text
from fedharness.problems import federated
from fedharness.problems.federated import Chunk, FederatedData, codes_or_floats
from fedharness.problems.leaf import LETTER_VOCAB, MODELS, UNKNOWN, letter_ids
from fedharness.registry.groups import DATASETS

WHAT = "a datasets.save_to_disk folder, a Parquet file or a folder of them, or a Hub id (flwrlabs/femnist)"
X_COLUMNS = ("image", "img", "pixels", "x")
Y_COLUMNS = ("label", "character", "y")
BATCH_ROWS = 4096
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _tables(root: str, path: Path | None) -> dict[str, Any]:
    """split -> an object whose `batches()` yields pyarrow record batches, and `columns`."""
    datasets = require_extra("datasets", "dataset", "hf")
    if path is None:  # a Hub id: downloaded into the datasets cache, then read like a saved folder
        hub_log = logging.getLogger("huggingface_hub")  # its retries log each failed request: one line is ours
        level = hub_log.level
        hub_log.setLevel(logging.ERROR)
        try:
            loaded = datasets.load_dataset(root)
        except Exception as err:  # no network, no such id: the user's to fix
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(federated.PATH_KEY, root, f"not a local path, and loading it from the Hub failed "
                                                        f"({reason}); expected {WHAT}") from None
        finally:
            hub_log.setLevel(level)
        return {s: _Arrow(d) for s, d in loaded.items() if s in ("train", "test")}
    if path.is_dir() and not any(path.rglob("*.parquet")):
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as err:
            raise federated.bad_file(root, path, f"not a saved Hugging Face data set ({err})") from None
        if isinstance(loaded, datasets.DatasetDict):
            return {s: _Arrow(d) for s, d in loaded.items() if s in ("train", "test")}
        return {"train": _Arrow(loaded)}
    files = [path] if path.is_file() else sorted(path.rglob("*.parquet"))
    test = [f for f in files if f.name.startswith("test")]
    train = [f for f in files if f not in test]
    return {"train": _Parquet(root, train), **({"test": _Parquet(root, test)} if test else {})}


class _Arrow:
    def __init__(self, dataset: Any):
        self.dataset, self.columns = dataset, list(dataset.column_names)
        self.files = [Path(f["filename"]) for f in dataset.cache_files]

    def batches(self) -> Iterator[Any]:
        yield from self.dataset.with_format("arrow").iter(batch_size=BATCH_ROWS)


class _Parquet:
    def __init__(self, root: str, files: list[Path]):
        self.pq = require_extra("pyarrow.parquet", "dataset", "hf")
        self.root, self.files = root, files
        try:
            self.columns = list(self.pq.read_schema(files[0]).names) if files else []
        except Exception as err:  # pyarrow's ArrowInvalid: not a Parquet file
            raise federated.bad_file(root, files[0], f"not a Parquet file ({err})") from None

    def batches(self) -> Iterator[Any]:
        for f in self.files:
            try:
                yield from self.pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS)
            except Exception as err:
                raise federated.bad_file(self.root, f, f"not a Parquet file ({err})") from None


def _column(key: str, given: str | None, columns: list[str], candidates: tuple[str, ...]) -> str:
    if given is not None:
        require(given in columns, key, given, f"a column of the data set; its columns: {', '.join(columns)}")
        return given
    found = [c for c in candidates if c in columns]
    require(bool(found), key, None, f"one of the data set's columns ({', '.join(columns)}); none is called "
                                    f"{', '.join(candidates)}")
    return found[0]


def _x(values: list, key: str, column: str, codes: bool) -> np.ndarray:
    first = values[0]
    if isinstance(first, dict) and "bytes" in first:  # an Image: PNG or JPEG bytes
        image = require_extra("PIL.Image", key, column)
        arrays = [np.asarray(image.open(io.BytesIO(v["bytes"]))) for v in values]
        x = np.stack(arrays)
        x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)  # [n, C, H, W] uint8: already codes
        return x if codes else x.astype(np.float32) / np.float32(federated.PIXEL_CODES)
    if isinstance(first, str):
        return _letters(values, key, column)
    x = np.asarray(values, dtype=np.float64)
    if x.ndim == 2:
        x = x.reshape(len(x), *federated.image_shape(x.shape[1]))
    elif x.ndim == 3:
        x = x[:, None]
    return codes_or_floats(x, codes)


def _letters(values: list, key: str, column: str) -> np.ndarray:
    try:
        return letter_ids(values)
    except ValueError as err:
        raise ConfigError(key, column, f"a column of strings: each {err}") from None


def _y(values: list, key: str, column: str) -> np.ndarray:
    if values and isinstance(values[0], str):
        ids = _letters(values, key, column)
        require(ids.shape[1] == 1, key, column, "a column of integer classes or of single characters")
        return ids[:, 0].astype(np.int64)
    y = np.asarray(values)
    require(np.issubdtype(y.dtype, np.integer) and (y >= 0).all(), key, column,
            "a column of integer classes >= 0 or of single characters")
    return y.astype(np.int64)


def _chunks(table: Any, columns: tuple[str, str, str], codes: bool, kinds: set[str]) -> Iterator[Chunk]:
    client, xc, yc = columns
    for batch in table.batches():
        owners = batch.column(client).to_pylist()
        require(all(o is not None and str(o) != "" for o in owners), "dataset.client_column", client,
                "a column naming every sample's owner; a row has none (an empty client)")
        x = _x(batch.column(xc).to_pylist(), "dataset.x_column", xc, codes)
        kinds.add("text" if x.dtype == np.uint8 and x.ndim == 2 else "image")
        yield x, _y(batch.column(yc).to_pylist(), "dataset.y_column", yc), np.asarray([str(o) for o in owners])


def load_hf(path: str | None, client_column: str | None, x_column: str | None = None, y_column: str | None = None,
            cache_dir: str | None = None) -> FederatedData:
    """The Hugging Face data set at `path` (or Hub id), from the cache after its first read."""
    require(path is not None and str(path) != "", federated.PATH_KEY, path, f"required: {WHAT}")
    local = Path(str(path)).expanduser()
    hub = not local.exists() and HUB_ID.match(str(path)) is not None
    root = None if hub else federated.require_path(path, WHAT)
    splits = _tables(str(path), root)
    require("train" in splits and bool(splits["train"].columns), federated.PATH_KEY, str(path),
            f"a train split with samples; expected {WHAT}")
    names = splits["train"].columns
    require(client_column is not None, "dataset.client_column", None,
            f"required: the column naming each sample's owner; its columns: {', '.join(names)}")
    columns = (_column("dataset.client_column", client_column, names, ()),
               _column("dataset.x_column", x_column, names, X_COLUMNS),
               _column("dataset.y_column", y_column, names, Y_COLUMNS))
    files = [f for table in splits.values() for f in table.files]

    def read_all(codes: bool):
        kinds: set[str] = set()
        train = list(_chunks(splits["train"], columns, codes, kinds))
        test = list(_chunks(splits["test"], columns, codes, kinds)) if "test" in splits else None
        return train, test, kinds

    def read():
        (train, test, kinds), codes = federated.read_with_codes(read_all)
        text_task = kinds == {"text"}
        meta = {"task": "text" if text_task else "image", "num_classes": LETTER_VOCAB if text_task else None,
                "token_vocab": LETTER_VOCAB if text_task else None,
                "x_scale": None if text_task or not codes else 1.0 / federated.PIXEL_CODES,
                **federated.unknown_meta((UNKNOWN, "character outside LEAF's 80 letters", True) if text_task else None)}
        return iter(train), None if test is None else iter(test), meta

    return federated.load_federated("hf", files, {"columns": columns}, cache_dir, read)


def hf_dataset(path: str | None = None, client_column: str | None = None, x_column: str | None = None,
               y_column: str | None = None, cache_dir: str | None = None, holdout: float | None = None,
               seed: int = 0):
    """dataset=hf: the pooled samples with each one's owner (the client column)."""
    data = load_hf(path, client_column, x_column, y_column, cache_dir)
    return data.pooled(MODELS[data.task], holdout, seed)


DATASETS.add("hf", hf_dataset, {
    **federated.keys(WHAT),
    "client_column": text("the column naming each sample's owner (flwrlabs/femnist: writer_id)",
                          null="required"),
    "x_column": text("the samples' column", null="image, img, pixels or x, whichever exists"),
    "y_column": text("the labels' column", null="label, character or y, whichever exists"),
})
