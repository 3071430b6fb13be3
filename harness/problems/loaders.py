"""Real datasets as pooled numpy arrays (partitioning happens elsewhere).

``load_pooled(name, data_dir)`` returns ``(x_train, y_train, x_test, y_test)``:
images float32 ``[n, C, H, W]``, scaled to [0, 1] and then normalized with the
dataset's standard per-channel mean/std; labels int64.

The files are parsed here with numpy rather than through torchvision's dataset
classes: those insist on md5 checksums (CIFAR-10) or on uncompressed files
(MNIST), and a user who already has the files should not need either.
torchvision is used only to download, and its folder layout is the one we read:

* MNIST          ``<data_dir>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``
* Fashion-MNIST  ``<data_dir>/FashionMNIST/raw/`` with the same file names
* CIFAR-10       ``<data_dir>/cifar-10-batches-py/{data_batch_1..5,test_batch}``

MNIST-like files lying directly in ``data_dir`` are accepted too. CIFAR-10 batches are
pickles: they are read with an unpickler that builds numpy arrays, lists, strings and
numbers only, so a planted batch cannot run code.
"""

from __future__ import annotations

import gzip
import os
import pickle
from typing import Callable

import numpy as np

from fedharness.errors import ConfigError
from fedharness.problems.pooled import PooledData
from fedharness.registry.groups import DATASETS
from fedharness.base.extras import require_extra
from fedharness.keys import Key, boolean, text

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

DATA_DIR_KEY = "dataset.data_dir"

# Per-channel (mean, std) of the training images scaled to [0, 1]. The digits
# values are those of all 1797 images / 16 (it has no customary constants).
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "digits": ((0.3053,), (0.3760,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    # The true per-pixel std of CIFAR-10, not the 0.2023/0.1994/0.2010 often copied.
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}

IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST = ("test_batch",)

# torchvision keeps MNIST-like files under <root>/<class name>/raw/.
MNIST_FOLDERS = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST"}


def normalize(images_01: np.ndarray, name: str) -> np.ndarray:
    """Standardize [n, C, H, W] images in [0, 1] with the dataset's mean/std, in float32."""
    mean, std = NORMALIZATION[name]
    mean_c = np.asarray(mean, dtype=np.float32)[:, None, None]
    std_c = np.asarray(std, dtype=np.float32)[:, None, None]
    return ((images_01.astype(np.float32) - mean_c) / std_c).astype(np.float32)


def _from_uint8(images: np.ndarray, name: str) -> np.ndarray:
    return normalize(images.astype(np.float32) / np.float32(255.0), name)


# --------------------------------------------------------------------- digits


def load_digits_arrays() -> Arrays:
    """scikit-learn's bundled 8x8 digits, split 80/20 by a fixed seed-0 permutation."""
    digits = require_extra("sklearn.datasets", "dataset", "digits").load_digits()  # the `data` extra
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))
    n_test = len(labels) // 5
    train, test = order[n_test:], order[:n_test]
    x = normalize(images, "digits")
    return x[train], labels[train], x[test], labels[test]


# ---------------------------------------------------------------- MNIST-like


def _bad_file(data_dir: str, path: str, why: str) -> ConfigError:
    return ConfigError(DATA_DIR_KEY, data_dir, f"{path} is not a valid dataset file: {why}")


def read_idx(path: str, data_dir: str) -> np.ndarray:
    """Parse an IDX file (plain or gzip) of unsigned bytes into a uint8 array."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as err:
        raise _bad_file(data_dir, path, str(err)) from err
    # Header: two zero bytes, a type code (0x08 = unsigned byte), the number of
    # dimensions, then one big-endian int32 per dimension.
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise _bad_file(data_dir, path, "expected an IDX header of unsigned bytes")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise _bad_file(data_dir, path, "truncated header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    body = np.frombuffer(raw, dtype=np.uint8, offset=header)
    if body.size != int(np.prod(shape)):
        raise _bad_file(data_dir, path, f"header says {shape}, found {body.size} bytes of data")
    return body.reshape(shape)


def _idx_dirs(name: str, data_dir: str) -> list[str]:
    return [os.path.join(data_dir, MNIST_FOLDERS[name], "raw"), data_dir]


def _find_idx(name: str, data_dir: str, stem: str) -> str | None:
    for folder in _idx_dirs(name, data_dir):
        for candidate in (stem, stem + ".gz"):
            path = os.path.join(folder, candidate)
            if os.path.isfile(path):
                return path
    return None


def _idx_hint(name: str, data_dir: str) -> str:
    raw = os.path.join(data_dir, MNIST_FOLDERS[name], "raw") + os.sep
    return (
        f"put {', '.join(IDX_FILES)} (optionally .gz) under {raw}, "
        "or pass dataset.download=true with network access"
    )


def _missing_idx(name: str, data_dir: str) -> list[str]:
    return [stem for stem in IDX_FILES if _find_idx(name, data_dir, stem) is None]


def _idx_pair(name: str, data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    images_path = _find_idx(name, data_dir, f"{split}-images-idx3-ubyte")
    labels_path = _find_idx(name, data_dir, f"{split}-labels-idx1-ubyte")
    assert images_path is not None and labels_path is not None  # checked by the caller
    images = read_idx(images_path, data_dir)
    labels = read_idx(labels_path, data_dir)
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise _bad_file(
            data_dir, images_path, f"images {images.shape} do not pair with labels {labels.shape}"
        )
    if labels.size and labels.max() > 9:
        raise _bad_file(data_dir, labels_path, f"label {int(labels.max())} outside 0..9")
    return _from_uint8(images[:, None, :, :], name), labels.astype(np.int64)


def _download_idx(name: str, data_dir: str) -> None:
    from torchvision import datasets

    cls = datasets.MNIST if name == "mnist" else datasets.FashionMNIST
    # Constructing the dataset with download=True fetches all four files
    # (train and test) into <data_dir>/<class name>/raw/ and extracts them.
    cls(root=data_dir, train=True, download=True)


def load_idx_dataset(name: str, data_dir: str, download: bool = False) -> Arrays:
    """MNIST or Fashion-MNIST from IDX files in torchvision's layout."""
    _ensure_files(name, data_dir, download, lambda: _missing_idx(name, data_dir), _idx_hint, _download_idx)
    x_train, y_train = _idx_pair(name, data_dir, "train")
    x_test, y_test = _idx_pair(name, data_dir, "t10k")
    return x_train, y_train, x_test, y_test


# ------------------------------------------------------------------ CIFAR-10


def _cifar_hint(name: str, data_dir: str) -> str:
    folder = os.path.join(data_dir, CIFAR10_FOLDER) + os.sep
    files = ", ".join(CIFAR10_TRAIN + CIFAR10_TEST)
    return (
        f"put the extracted {CIFAR10_FOLDER}/ folder of cifar-10-python.tar.gz "
        f"({files}) at {folder}, or pass dataset.download=true with network access"
    )


def _missing_cifar(data_dir: str) -> list[str]:
    folder = os.path.join(data_dir, CIFAR10_FOLDER)
    return [f for f in CIFAR10_TRAIN + CIFAR10_TEST if not os.path.isfile(os.path.join(folder, f))]


# What a CIFAR-10 batch pickle may name: numpy's array, dtype and scalar rebuilders (numpy 1 and 2
# spellings, protocols 2 to 5) and the bytes decoder of protocol-2 pickles written by Python 3.
# Anything else (os.system, eval, ...) is refused before it runs.
CIFAR_PICKLE_GLOBALS = frozenset({
    *((mod, name) for mod in ("numpy.core.multiarray", "numpy._core.multiarray") for name in ("_reconstruct", "scalar")),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
})


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in CIFAR_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"refused to load {module}.{name}: a CIFAR-10 batch holds only "
                                         "numpy arrays, lists, strings and numbers")
        return super().find_class(module, name)


def _read_cifar_batch(path: str, data_dir: str) -> tuple[np.ndarray, np.ndarray]:
    # The official batches are Python 2 pickles; latin1 decodes their byte
    # strings the way torchvision does, giving str keys (bytes keys come from
    # batches re-pickled under Python 3).
    try:
        with open(path, "rb") as f:
            entry = _ArrayUnpickler(f, encoding="latin1").load()
        entry = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in entry.items()}
        data = np.asarray(entry["data"], dtype=np.uint8)
        labels = np.asarray(entry["labels"], dtype=np.int64)
    except Exception as err:  # any unreadable pickle is a data problem for the user
        raise _bad_file(data_dir, path, f"{type(err).__name__}: {err}") from err
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(data) != len(labels):
        raise _bad_file(data_dir, path, f"data {data.shape} / labels {labels.shape}, expected [n, 3072] / [n]")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise _bad_file(data_dir, path, "labels outside 0..9")
    # Rows are channel-major (1024 red, 1024 green, 1024 blue), i.e. CHW.
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_split(data_dir: str, files: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    parts = [_read_cifar_batch(os.path.join(data_dir, CIFAR10_FOLDER, f), data_dir) for f in files]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return _from_uint8(images, "cifar10"), labels


def _download_cifar(name: str, data_dir: str) -> None:
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive

    # Downloads cifar-10-python.tar.gz (md5-checked) and extracts it into data_dir; not through
    # CIFAR10(download=True), which would then unpickle the batches without restriction.
    download_and_extract_archive(CIFAR10.url, data_dir, filename=CIFAR10.filename, md5=CIFAR10.tgz_md5)


def load_cifar10(data_dir: str, download: bool = False) -> Arrays:
    """CIFAR-10 from the extracted python batches."""
    _ensure_files("cifar10", data_dir, download, lambda: _missing_cifar(data_dir), _cifar_hint, _download_cifar)
    x_train, y_train = _cifar_split(data_dir, CIFAR10_TRAIN)
    x_test, y_test = _cifar_split(data_dir, CIFAR10_TEST)
    return x_train, y_train, x_test, y_test


# ------------------------------------------------------------------- common


def _ensure_files(
    name: str,
    data_dir: str,
    download: bool,
    missing: Callable[[], list[str]],
    hint: Callable[[str, str], str],
    fetch: Callable[[str, str], None],
) -> None:
    """Download if allowed and needed; otherwise say exactly which files go where."""
    absent = missing()
    if not absent:
        return
    if not download:
        raise ConfigError(DATA_DIR_KEY, data_dir, f"missing {', '.join(absent)}: {hint(name, data_dir)}")
    try:
        fetch(name, data_dir)
    except Exception as err:  # no network, bad mirror, checksum mismatch, read-only dir...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            DATA_DIR_KEY, data_dir, f"downloading {name} failed ({reason}); {hint(name, data_dir)}"
        ) from err
    absent = missing()
    if absent:
        raise ConfigError(
            DATA_DIR_KEY, data_dir, f"still missing {', '.join(absent)} after download: {hint(name, data_dir)}"
        )


LOADERS: dict[str, Callable[[str, bool], Arrays]] = {
    "digits": lambda data_dir, download: load_digits_arrays(),
    "mnist": lambda data_dir, download: load_idx_dataset("mnist", data_dir, download),
    "fashion_mnist": lambda data_dir, download: load_idx_dataset("fashion_mnist", data_dir, download),
    "cifar10": load_cifar10,
}
KEYS: dict[str, Key] = {  # every loader's, besides num_clients and data_seed
    "data_dir": text("where the files are read from (torchvision's layout)"),
    "download": boolean("let torchvision download when the network allows"),
}


def load_pooled(name: str, data_dir: str, download: bool = False) -> Arrays:
    """Load dataset `name` as (x_train float32, y_train int64, x_test float32, y_test int64)."""
    if name not in LOADERS:
        raise ConfigError("dataset", name, LOADERS.keys())
    return LOADERS[name](str(data_dir), download)


def pooled(load: Callable[[str, bool], Arrays], data_dir: str = "data", download: bool = False) -> PooledData:
    """A file data set (`dataset=mnist`, ...) read by its loader."""
    return PooledData(*load(str(data_dir), bool(download)))


for _name, _load in LOADERS.items():
    DATASETS.add(_name, pooled, KEYS, load=_load)
