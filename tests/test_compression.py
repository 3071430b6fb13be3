"""Compressed client updates (algorithms/compression.py; docs/compression.md): each compressor against an
independent numpy version on updates captured from a run, error feedback's identity over the rounds, bytes_up
equal to each encoding's size, the same bits on 1 and 3 shards, on Ray, in a batch of seeds and after a resume, a
compressor registered from Python, and bad input refused with one line."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import fedharness
from fedharness.algorithms.compression import CompressUpdates, RandomK, TopK
from fedharness.base import streams
from fedharness.cli import main
from fedharness.config.load import load_settings
from fedharness.contracts import ClientWork, Compressor, UpdateStage
from fedharness.core import kernels
from fedharness.runs.execute import execute
from round_rows import rows, run_rows
from test_same_bits import StopAt

pytestmark = pytest.mark.numeric  # compares numbers with independent computations: `make test-kernels` too

BASE = ["dataset=digits", "rounds=4", "eval_every=2", "progress=false", "threads=1", "reference=off",
        "heterogeneity=false", "dtype=float64", "replicas=2", "algorithm.local_steps=5", "dataset.data_seed=0",
        "algorithm.sampler=scheme_ii", "algorithm.clients_per_round=5"]
SEED = 0


# --- independent numpy versions -------------------------------------------------------------------------------

def np_keep(v: np.ndarray, index: np.ndarray) -> np.ndarray:
    out = np.zeros_like(v)
    rows = np.arange(len(v))[:, None]
    out[rows, index] = v[rows, index]
    return out


def np_k(ratio: float, d: int) -> int:
    return max(1, min(d, int(np.rint(ratio * d))))


def np_topk(v: np.ndarray, ratio: float) -> np.ndarray:
    return np_keep(v, np.argsort(-np.abs(v), axis=1, kind="stable")[:, :np_k(ratio, v.shape[1])])


def np_randomk(v: np.ndarray, ratio: float, u: np.ndarray) -> np.ndarray:
    return np_keep(v, np.argsort(u, axis=1, kind="stable")[:, :np_k(ratio, v.shape[1])])


def np_halves(x: np.ndarray) -> np.ndarray:
    """Row sums by halves over a zero-padded power of two (the order the product documents)."""
    size = 1
    while size < x.shape[1]:
        size *= 2
    x = np.concatenate([x, np.zeros((len(x), size - x.shape[1]))], axis=1)
    while x.shape[1] > 1:
        x = x[:, :x.shape[1] // 2] + x[:, x.shape[1] // 2:]
    return x[:, 0]


def np_qsgd(v: np.ndarray, s: int, u: np.ndarray) -> np.ndarray:
    norm = np.sqrt(np_halves(v * v))[:, None]
    r = np.abs(v) / np.maximum(norm, np.finfo(np.float64).tiny) * s
    level = np.floor(r) + (u < r - np.floor(r))
    return norm * np.sign(v) * level / s


def np_sign(v: np.ndarray) -> np.ndarray:
    scale = (np_halves(np.abs(v)) / v.shape[1])[:, None]
    return np.where(v >= 0, scale, -scale)


# --- capturing what enters and leaves the compress stage (inline: the shards run in this process) -------------

CAPTURED: dict[str, list] = {"in": [], "out": []}


@dataclass(frozen=True)
class Record(ClientWork):
    where: str
    round: int
    stream_replicas: np.ndarray

    def transform(self, delta, replica, clients):
        for r, k, d in zip(replica, clients, delta):
            CAPTURED[self.where].append((self.round, int(self.stream_replicas[r]), int(k), d.clone()))
        return delta, {}


class Capture(UpdateStage):
    def __init__(self, where: str = "in"):
        self.where = where

    def client_work(self, plan, counters):
        return Record(self.where, plan.round, plan.stream_replicas)


fedharness.register_stage("capture_in", Capture, where="in")
fedharness.register_stage("capture_out", Capture, where="out")
CAPTURING = "stages=[capture_in,compress,capture_out]"


def captured(tmp_path, *overrides: str) -> tuple[dict, dict]:
    for part in CAPTURED.values():
        part.clear()
    assert execute(load_settings([*BASE, f"results_dir={tmp_path}", CAPTURING, *overrides])).status == "ok"
    by_key = [{(rnd, r, k): d for rnd, r, k, d in CAPTURED[w]} for w in ("in", "out")]
    assert by_key[0].keys() == by_key[1].keys() and len(by_key[0]) == 4 * 2 * 5  # rounds x replicas x K
    return by_key[0], by_key[1]


def stacked(by_key: dict) -> tuple[list, np.ndarray]:
    keys = sorted(by_key)
    return keys, np.stack([by_key[k].numpy() for k in keys])


def draws(keys: list, dim: int) -> np.ndarray:
    """Each captured update's uniforms from its stream (seed, replica, round, client)."""
    return np.stack([streams.uniform(streams.stream_key(SEED, streams.COMPRESS, r, rnd, k), dim) for rnd, r, k in keys])


@pytest.mark.parametrize("option,reference", [
    (["compress=topk", "compress.ratio=0.05"], lambda v, u: np_topk(v, 0.05)),
    (["compress=randomk", "compress.ratio=0.1"], lambda v, u: np_randomk(v, 0.1, u)),
    (["compress=qsgd", "compress.levels=2"], lambda v, u: np_qsgd(v, 2, u)),
    (["compress=sign"], lambda v, u: np_sign(v)),
])
def test_each_compressor_sends_what_an_independent_numpy_version_does(option, reference, tmp_path):
    before, after = captured(tmp_path, *option, "compress.error_feedback=false")
    keys, v = stacked(before)
    _, sent = stacked(after)
    want = reference(v, draws(keys, v.shape[1]))
    # exact: the product documents its order of additions (tree_sums, repeated here by np_halves); the rest are
    # selections and single correctly rounded operations (*, /, sqrt, floor): the same bits on any CPU
    assert np.array_equal(sent, want)
    assert not np.array_equal(sent, v)  # the update was compressed


def test_the_captured_updates_are_the_dense_run_s_without_compression(tmp_path):
    """The capture sees what the shards trained (the compress stage left out under compress=none)."""
    before, after = captured(tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("option", [["compress=topk", "compress.ratio=0.05"], ["compress=randomk", "compress.ratio=0.1"],
                                    ["compress=qsgd", "compress.levels=2"], ["compress=sign"]])
def test_error_feedback_sends_the_sum_of_the_true_updates_over_the_rounds(option, tmp_path):
    """For each client: the sum of what it sent plus its final residual equals the sum of its true updates, to
    within n eps max|v| (n: its rounds; each round's v + e rounds once). The residuals after round 3 are read
    back from the run's checkpoint, as a resume reads them."""
    for part in CAPTURED.values():
        part.clear()
    settings = load_settings([*BASE, f"results_dir={tmp_path}", CAPTURING, *option, "compress.error_feedback=true",
                              "checkpoint_every=3"])
    assert execute(settings, run_id="ef", callbacks=[StopAt(3)]).status == "stopped"
    residual = {key: s["ef_residual"].numpy() for key, s in kept_state(settings, "ef").items()}
    true, sent, largest, rounds = {}, {}, {}, {}
    for where, table in (("in", true), ("out", sent)):
        for rnd, r, k, d in CAPTURED[where]:
            table[(r, k)] = table.get((r, k), 0) + d.numpy()
            if where == "in":
                largest[(r, k)] = max(largest.get((r, k), 0.0), float(np.abs(d.numpy()).max()))
                rounds[(r, k)] = rounds.get((r, k), 0) + 1
    assert residual.keys() == true.keys() and len(true) > 10
    for key in true:
        v_max = largest[key] + float(np.abs(residual[key]).max())
        err = np.abs(sent[key] + residual[key] - true[key]).max()
        assert err <= rounds[key] * np.finfo(np.float64).eps * v_max, (key, err)


@pytest.mark.parametrize("compressor", [TopK(0.05), RandomK(0.1)])
def test_error_feedback_is_exact_for_the_masking_compressors(compressor):
    """On updates of a dyadic grid (every sum exact in float64), what was sent plus the final residual is the sum of
    the true updates bit for bit: a masking compressor's residual keeps v's own entries."""
    rng = np.random.default_rng(3)
    work = CompressUpdates(compressor, SEED, np.arange(2), 0, "ef_residual")
    replica, clients = np.array([0, 0, 1]), np.array([4, 9, 4])
    kept, total_sent, total_true = [None, None, None], 0, 0
    for rnd in range(30):
        d = torch.as_tensor(rng.integers(-2 ** 20, 2 ** 20, (3, 200)) * 2.0 ** -24)
        work = CompressUpdates(compressor, SEED, np.arange(2), rnd, "ef_residual")
        sent, counts, after = work.transform(d, replica, clients, kept)
        kept = list(after)
        total_sent, total_true = total_sent + sent, total_true + d
    assert torch.equal(total_sent + torch.stack(kept), total_true)


def kept_state(settings, run_id: str) -> dict:
    """The client state of the run's last checkpoint, as `resume` loads it."""
    from fedharness.core.checkpoint import load_resume

    from fedharness.core.client_store import checkpointed_values
    from fedharness.results.store import open_store

    return checkpointed_values(open_store(settings.results_dir), load_resume(settings.replace(resume=run_id)).client_files)


def dim_of(settings) -> int:
    from fedharness.assembly.build import build_parts

    return build_parts(settings)[0].dim


@pytest.mark.parametrize("option,size", [
    (["compress=none"], lambda d: d * 8),
    (["compress=topk", "compress.ratio=0.05"], lambda d: round(0.05 * d) * (4 + 8)),
    (["compress=randomk", "compress.ratio=0.1"], lambda d: round(0.1 * d) * 8 + 8),
    (["compress=qsgd", "compress.levels=2"], lambda d: 8 + math.ceil(d * (1 + 2) / 8)),  # 2 levels: 2 bits
    (["compress=qsgd", "compress.levels=4"], lambda d: 8 + math.ceil(d * (1 + 3) / 8)),  # 4 levels: 3 bits
    (["compress=sign"], lambda d: 8 + math.ceil(d / 8)),
])
def test_bytes_up_counts_each_clients_encoded_update(option, size, tmp_path):
    """scheme_ii: K = 5 distinct clients a round; bytes_down stays the dense model."""
    settings = load_settings([*BASE, f"results_dir={tmp_path}", *option])
    d = dim_of(settings)
    assert execute(settings, run_id="b").status == "ok"
    last = [r for r in rows(tmp_path, "b") if r[1] == 4]
    assert [r[7] for r in last] == [4 * 5 * size(d)] * 2  # bytes_up
    assert [r[8] for r in last] == [4 * 5 * d * 8] * 2  # bytes_down


def run(tmp_path, run_id: str, *extra: str) -> list[tuple]:
    return run_rows(BASE, tmp_path, run_id, *extra)


# --- a compressor registered from Python: one bit a coordinate -----------------------------------------------

@dataclass(frozen=True)
class OneBit(Compressor):
    """The sign of each coordinate times a fixed step: one bit a coordinate, nothing else."""

    step: float = 0.01

    def compress(self, v, keys):
        return torch.where(v >= 0, self.step, -self.step).to(v.dtype)

    def encoded_bytes(self, dim, value_bytes):
        return math.ceil(dim / 8)


fedharness.register_compressor("one_bit", OneBit, error_feedback=True, step=0.01)

STATEFUL = {"topk": ["compress=topk", "compress.ratio=0.05"], "qsgd": ["compress=qsgd", "compress.error_feedback=true"],
            "one_bit": ["compress=one_bit"]}


@pytest.mark.parametrize("name", STATEFUL)
def test_the_same_bits_on_1_and_3_shards_in_a_batch_of_seeds_and_after_a_resume(name, tmp_path):
    from fedharness.runs.batch import Slot
    from fedharness.runs.execute import execute_batch

    option = STATEFUL[name]
    one = run(tmp_path, "one", *option)
    assert one == run(tmp_path, "three", *option, "num_shards=3")
    assert one != run(tmp_path, "dense")  # compression changed the run
    cut = load_settings([*BASE, f"results_dir={tmp_path}", *option, "checkpoint_every=1"])
    assert execute(cut, run_id="cut", callbacks=[StopAt(2)]).status == "stopped"
    assert execute(cut.replace(resume="cut")).status == "ok"
    assert rows(tmp_path, "cut") == one
    slots = [Slot(load_settings([*BASE, f"results_dir={tmp_path}", *option, *extra]), run_id=run_id)
             for run_id, extra in (("slot0", []), ("slot1", ["seed=1"]))]
    assert [r.status for r in execute_batch(slots)] == ["ok", "ok"]
    assert rows(tmp_path, "slot0") == one
    assert rows(tmp_path, "slot1") == run(tmp_path, "alone1", *option, "seed=1")


@pytest.mark.slow  # CI only: a local Ray
def test_the_inline_bits_on_2_and_3_ray_shards(local_ray, tmp_path):
    """A user's compressor (one_bit) travels to the shards by value: its module is not installed."""
    for name, shards in (("topk", 2), ("topk", 3), ("qsgd", 3), ("one_bit", 2)):
        inline = run(tmp_path, f"inline_{name}", *STATEFUL[name])
        assert run(tmp_path, f"ray_{name}_{shards}", *STATEFUL[name], "executor=ray", f"ray.num_shards={shards}") \
            == inline


# --- bad input ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,key,hint", [
    (["compress=topk", "compress.ratio=0"], "compress.ratio", "in (0, 1]"),
    (["compress=randomk", "compress.ratio=1.5"], "compress.ratio", "in (0, 1]"),
    (["compress=qsgd", "compress.levels=0"], "compress.levels", "an integer >= 1"),
    (["compress=topk", "compress.nope=1"], "compress.nope", "keys of 'compress': error_feedback, ratio"),
    (["compress=zip"], "compress", "one of: none, "),
    (["compress=topk", "stages=[attack,dp]"], "stages", "compress=topk runs as the stage 'compress'"),
    (["compress=topk", "stages=[attack,dp,compress]", "algorithm=dp_fedavg", "dp.noise_multiplier=1"], "stages",
     "compress before dp"),
    (["compress=topk", "model=resnet18_bn", "kernel=loop"], "compress", "a model without buffers"),
    (["dataset=quadratic_lazy", "dataset.num_clients=100000000", "dataset.dim=1000", "rounds=100000",
      "algorithm.clients_per_round=100", "memory_budget_gb=1", "compress=topk"], "memory_budget_gb",
     "the client slot 'ef_residual' (8,000 bytes a client; all slots 8,000) x 10,000,000 clients that can hold one x "
     "2 replicas"),
])
def test_bad_compression_input_is_one_line_exit_2_and_nothing_written(overrides, key, hint, tmp_path, capsys):
    results = tmp_path / "out"
    assert main(["run", f"results_dir={results}", *BASE, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"'{key}'" in err and hint in err, err
    assert not results.exists()


def test_a_compressor_on_a_model_with_buffers_is_refused_before_kernel_timing_and_any_file(tmp_path, monkeypatch,
                                                                                          capsys):
    """The default kernel=auto times the kernels (about 95 s for resnet18_bn) and remembers its choice in the cache:
    the refusal comes first, so nothing is timed and neither the cache nor results_dir gets a file."""
    cache, results = tmp_path / "cache", tmp_path / "out"
    cache.mkdir()
    monkeypatch.setenv("FEDHARNESS_CACHE", str(cache))
    timed = []
    monkeypatch.setattr(kernels, "measure", lambda *args, **kwargs: timed.append(args) or {"loop": 1.0})
    code = main(["run", "dataset=digits", "model=resnet18_bn", "compress=topk", "rounds=1", f"results_dir={results}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "'compress': 'topk'" in err and "a model without buffers" in err, err
    assert timed == [] and list(cache.iterdir()) == [] and not results.exists()


def test_error_feedback_on_a_lazy_population_within_the_budget_keeps_residuals_only_for_its_participants(tmp_path):
    """10^8 clients, 3 rounds of 4: 12 residuals a replica, whatever N is."""
    settings = load_settings([*BASE, f"results_dir={tmp_path}", "dataset=quadratic_lazy",
                              "dataset.num_clients=100000000", "dataset.dim=50", "rounds=4", "eval_every=4",
                              "algorithm.clients_per_round=4", "memory_budget_gb=1", "compress=topk",
                              "compress.ratio=0.1", "checkpoint_every=3"])
    assert execute(settings, run_id="lazy", callbacks=[StopAt(3)]).status == "stopped"
    kept = kept_state(settings, "lazy")
    assert len(kept) == 2 * 3 * 4 and all(s["ef_residual"].shape == (50,) for s in kept.values())


def test_with_dp_each_compressed_update_is_clipped_last(tmp_path):
    """stages=[compress, dp]: QSGD's output (norm above the update's) and error feedback's residual are clipped to
    dp.clip_norm before the sum, so DP-FedAvg's sensitivity bound holds."""
    for part in CAPTURED.values():
        part.clear()
    settings = load_settings([*BASE, f"results_dir={tmp_path}", "algorithm=dp_fedavg", "algorithm.sampler=poisson",
                              "dp.noise_multiplier=0.5",
                              "dp.clip_norm=0.05", "compress=qsgd", "compress.levels=1", "compress.error_feedback=true",
                              "stages=[compress,dp,capture_out]"])
    assert execute(settings).status == "ok"
    norms = np.array([float(d.norm()) for _, _, _, d in CAPTURED["out"]])
    assert len(norms) > 10 and norms.max() <= 0.05 * (1 + 1e-12) and (norms > 0.05 * (1 - 1e-9)).any()
