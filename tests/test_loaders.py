"""Dataset loaders: file formats, layout, normalization and the errors a user sees."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path
from urllib.error import URLError

import numpy as np
import pytest

from fedharness.errors import ConfigError
from fedharness.problems import loaders
from fedharness.problems.loaders import IDX_FILES, load_pooled
from fakes import fake_mnist as _fake_mnist

REAL_MNIST = Path("/work/shared/data/mnist")


def _fake_cifar(root: Path, per_batch: int, seed: int = 0) -> dict[str, dict]:
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "batch_label": name,
            "labels": [int(v) for v in rng.integers(0, 10, per_batch)],
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
        }
        # The official Python 2 pickles load with str keys under latin1; also
        # cover pickles re-saved from Python 3 with bytes keys.
        raw = {k.encode(): v for k, v in entry.items()} if name == "data_batch_2" else entry
        with open(folder / name, "wb") as f:
            pickle.dump(raw, f, protocol=2)
        batches[name] = entry
    return batches


def _expected(u8: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    x = u8.astype(np.float64) / 255.0
    m = np.asarray(mean)[:, None, None]
    s = np.asarray(std)[:, None, None]
    return (x - m) / s


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(("name", "folder"), [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_idx_in_torchvision_layout(tmp_path, gz, name, folder):
    arrays = _fake_mnist(tmp_path / folder / "raw", n_train=12, n_test=5, gz=gz)
    x_train, y_train, x_test, y_test = load_pooled(name, str(tmp_path))

    assert x_train.shape == (12, 1, 28, 28) and x_test.shape == (5, 1, 28, 28)
    assert x_train.dtype == np.float32 and x_test.dtype == np.float32
    assert y_train.dtype == np.int64 and y_test.dtype == np.int64
    np.testing.assert_array_equal(y_train, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(y_test, arrays["t10k-labels-idx1-ubyte"])

    mean, std = {"mnist": ((0.1307,), (0.3081,)), "fashion_mnist": ((0.2860,), (0.3530,))}[name]
    want = _expected(arrays["train-images-idx3-ubyte"][:, None], mean, std)
    np.testing.assert_allclose(x_train, want, rtol=1e-6, atol=1e-6)
    # Black and white pixels land exactly where the standard constants put them.
    assert np.isclose(x_train[0, 0, 0, 0], -mean[0] / std[0], rtol=1e-6, atol=0)
    assert np.isclose(x_train[0, 0, 0, 1], (1.0 - mean[0]) / std[0], rtol=1e-6, atol=0)


def test_idx_files_directly_in_data_dir_mixed_compression(tmp_path):
    arrays = _fake_mnist(tmp_path, n_train=4, n_test=3, gz=False)
    # One file compressed, the others plain: each is found on its own.
    path = tmp_path / "t10k-images-idx3-ubyte"
    (tmp_path / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(path.read_bytes()))
    path.unlink()
    x_train, y_train, x_test, y_test = load_pooled("mnist", str(tmp_path))
    assert x_test.shape == (3, 1, 28, 28)
    np.testing.assert_allclose(
        x_test, _expected(arrays["t10k-images-idx3-ubyte"][:, None], (0.1307,), (0.3081,)), rtol=1e-6, atol=1e-6
    )


def test_missing_mnist_files_say_which_and_where(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    _fake_mnist(raw, n_train=2, n_test=2, gz=True)
    (raw / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(ConfigError) as err:
        load_pooled("mnist", str(tmp_path))
    message = str(err.value)
    assert err.value.key == "dataset.data_dir" and err.value.value == str(tmp_path)
    assert "dataset.data_dir" in message and str(tmp_path) in message
    assert "missing t10k-labels-idx1-ubyte:" in message
    for stem in IDX_FILES:
        assert stem in message
    assert os.path.join(str(tmp_path), "MNIST", "raw") in message
    assert "dataset.download=true" in message


def test_empty_dir_fashion_mnist_points_to_its_own_folder(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_pooled("fashion_mnist", str(tmp_path))
    assert os.path.join(str(tmp_path), "FashionMNIST", "raw") in str(err.value)


def test_failed_download_is_a_config_error(tmp_path, monkeypatch):
    def no_network(name: str, data_dir: str) -> None:
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried ..., got: <urlopen error>")

    monkeypatch.setattr(loaders, "_download_idx", no_network)
    with pytest.raises(ConfigError) as err:
        load_pooled("mnist", str(tmp_path), download=True)
    message = str(err.value)
    assert "downloading mnist failed (Error downloading train-images-idx3-ubyte.gz:)" in message
    assert "train-images-idx3-ubyte" in message and str(tmp_path) in message


def test_download_not_attempted_when_files_present(tmp_path, monkeypatch):
    _fake_mnist(tmp_path / "MNIST" / "raw", n_train=2, n_test=2, gz=False)

    def fail(name: str, data_dir: str) -> None:
        raise AssertionError("must not download")

    monkeypatch.setattr(loaders, "_download_idx", fail)
    assert load_pooled("mnist", str(tmp_path), download=True)[0].shape == (2, 1, 28, 28)


def test_corrupt_idx_file_is_a_config_error(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    _fake_mnist(raw, n_train=3, n_test=2, gz=False)
    (raw / "train-images-idx3-ubyte").write_bytes(b"<html>not found</html>")
    with pytest.raises(ConfigError) as err:
        load_pooled("mnist", str(tmp_path))
    assert "train-images-idx3-ubyte" in str(err.value) and "IDX header" in str(err.value)


def test_truncated_idx_file_is_a_config_error(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    _fake_mnist(raw, n_train=3, n_test=2, gz=False)
    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ConfigError, match="header says"):
        load_pooled("mnist", str(tmp_path))


def test_cifar10_batches(tmp_path):
    batches = _fake_cifar(tmp_path, per_batch=4)
    x_train, y_train, x_test, y_test = load_pooled("cifar10", str(tmp_path))

    assert x_train.shape == (20, 3, 32, 32) and x_test.shape == (4, 3, 32, 32)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    train_names = [f"data_batch_{i}" for i in range(1, 6)]
    np.testing.assert_array_equal(y_train, np.concatenate([batches[b]["labels"] for b in train_names]))
    np.testing.assert_array_equal(y_test, batches["test_batch"]["labels"])

    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    u8 = np.concatenate([batches[b]["data"] for b in train_names]).reshape(-1, 3, 32, 32)
    np.testing.assert_allclose(x_train, _expected(u8, mean, std), rtol=1e-6, atol=1e-6)
    # Row layout is channel-major: byte 1024 of a row is the first green pixel.
    first = batches["test_batch"]["data"][0]
    assert np.isclose(x_test[0, 1, 0, 0], (first[1024] / 255 - mean[1]) / std[1], atol=1e-6)
    assert np.isclose(x_test[0, 2, 31, 31], (first[3071] / 255 - mean[2]) / std[2], atol=1e-6)


class _RunsCode:
    """Unpickling this calls `call(arg)`."""

    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return self.call, (self.arg,)


@pytest.mark.parametrize("call", [os.system, exec])
def test_cifar10_batch_that_runs_code_is_refused(tmp_path, call):
    _fake_cifar(tmp_path, per_batch=2)
    marker = tmp_path / "code-ran"
    command = f"touch {marker}" if call is os.system else f"open({str(marker)!r}, 'w').close()"
    path = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    with open(path, "wb") as f:
        pickle.dump({"labels": [1, 2], "data": _RunsCode(call, command)}, f, protocol=2)
    with pytest.raises(ConfigError) as err:
        load_pooled("cifar10", str(tmp_path))
    assert not marker.exists()  # refused before the call ran
    assert err.value.key == "dataset.data_dir" and f"{path} is not a valid dataset file" in str(err.value)
    name = "posix.system" if call is os.system else "__builtin__.exec"  # protocol 2 names builtins so
    assert f"refused to load {name}" in str(err.value)


@pytest.mark.parametrize("protocol", [2, 5])
def test_cifar10_batches_of_any_pickle_protocol_load(tmp_path, protocol):
    batches = _fake_cifar(tmp_path, per_batch=3)
    for name, entry in batches.items():  # re-saved from Python 3, numpy scalars among the labels
        with open(tmp_path / "cifar-10-batches-py" / name, "wb") as f:
            pickle.dump({**entry, "labels": [np.int64(v) for v in entry["labels"]]}, f, protocol=protocol)
    _, _, x_test, y_test = load_pooled("cifar10", str(tmp_path))
    np.testing.assert_array_equal(y_test, batches["test_batch"]["labels"])
    assert x_test.shape == (3, 3, 32, 32)


def test_missing_cifar10_batch_says_which_and_where(tmp_path):
    _fake_cifar(tmp_path, per_batch=2)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(ConfigError) as err:
        load_pooled("cifar10", str(tmp_path))
    message = str(err.value)
    assert err.value.key == "dataset.data_dir" and str(tmp_path) in message
    assert "missing data_batch_3:" in message
    assert os.path.join(str(tmp_path), "cifar-10-batches-py") in message
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        assert name in message


def test_digits_split(tmp_path):
    x_train, y_train, x_test, y_test = load_pooled("digits", str(tmp_path / "never-used"))
    assert len(x_train) + len(x_test) == 1797
    assert x_train.shape == (1438, 1, 8, 8) and x_test.shape == (359, 1, 8, 8)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64 and y_test.dtype == np.int64
    assert set(np.unique(np.concatenate([y_train, y_test]))) == set(range(10))
    # Pixels are 0..16 in the source: /16, then the stored mean/std.
    x_all = np.concatenate([x_train, x_test])
    pixels_01 = x_all * 0.3760 + 0.3053
    np.testing.assert_allclose(pixels_01 * 16, np.round(pixels_01 * 16), atol=1e-4)
    assert abs(x_all.mean()) < 1e-3 and abs(x_all.std() - 1) < 1e-3
    # Fixed seed: the split is the same every call.
    again = load_pooled("digits", "")
    np.testing.assert_array_equal(again[1], y_train)


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(ConfigError) as err:
        load_pooled("imagenet", "/tmp")
    assert err.value.key == "dataset"
    for name in ("digits", "mnist", "fashion_mnist", "cifar10"):
        assert name in str(err.value)


@pytest.mark.skipif(not (REAL_MNIST / "t10k-images-idx3-ubyte.gz").exists(), reason="no local MNIST test set")
def test_real_mnist_test_set(tmp_path):
    # Only the test files exist locally; pair them with tiny fake training files.
    raw = tmp_path / "MNIST" / "raw"
    _fake_mnist(raw, n_train=2, n_test=1, gz=False)
    for stem in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (raw / stem).unlink()
        (raw / f"{stem}.gz").symlink_to(REAL_MNIST / f"{stem}.gz")
    _, _, x_test, y_test = load_pooled("mnist", str(tmp_path))
    assert x_test.shape == (10_000, 1, 28, 28) and x_test.dtype == np.float32
    assert np.bincount(y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    # The standard constants come from the training set; the test set is close to them.
    assert abs(float(x_test.mean())) < 0.02 and abs(float(x_test.std()) - 1) < 0.02
    assert np.isclose(x_test.min(), -0.1307 / 0.3081, atol=1e-6)
    assert np.isclose(x_test.max(), (1 - 0.1307) / 0.3081, atol=1e-6)
