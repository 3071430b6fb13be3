"""Checkpoints load as plain data only: resume continues bit for bit, and a planted state.pt is refused unrun."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from fedharness import cli
from fedharness.config.load import load_settings
from fedharness.errors import ConfigError
from fedharness.runs.execute import execute
from ray_support import QUADRATIC, read_rounds

# SCAFFOLD keeps control variates per (replica, client); two replicas with averaging add series state
RUN = ["algorithm=scaffold", "algorithm.client_lr=0.1", "algorithm.average=true", "replicas=2", *QUADRATIC,
       "rounds=12", "eval_every=1", "checkpoint_every=4", "progress=false"]


class RunsCode:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _crash_at(results, stop_round: int) -> None:
    def on_eval(rows, state):
        if state.round == stop_round:
            raise RuntimeError("driver crashed")

    with pytest.raises(RuntimeError, match="driver crashed"):
        execute(load_settings([f"results_dir={results}", *RUN]), run_id="victim", on_eval=on_eval)


def test_resume_from_a_weights_only_checkpoint_is_bit_identical(tmp_path):
    execute(load_settings([f"results_dir={tmp_path / 'whole'}", *RUN]), run_id="whole")
    _crash_at(tmp_path / "cut", 10)  # last checkpoint at round 8
    state = tmp_path / "cut" / "checkpoints" / "run_id=victim" / "state.pt"
    payload = torch.load(state, weights_only=True)  # plain data: no class needs unpickling
    # one shard: its c_i written by itself at rounds 4 and 8, the state naming both files
    assert payload["round"] == 8 and [f.split("/")[-1] for f in payload["client_files"]] == [
        "round=00000004-clients=0-12.pt", "round=00000008-clients=0-12.pt"]
    assert "client_state" not in payload  # the driver holds no client's slots
    execute(load_settings([f"results_dir={tmp_path / 'cut'}", *RUN, "resume=victim"]))
    got, want = read_rounds(tmp_path / "cut", "victim"), read_rounds(tmp_path / "whole", "whole")
    assert [(r["series"], r["round"], r["replica"]) for r in got] == [(r["series"], r["round"], r["replica"])
                                                                    for r in want]
    for g, w in zip(got, want):
        for name in ("train_loss", "subopt", "dist_to_opt", "grad_norm_sq", "local_steps", "grad_evals"):
            assert g[name] == w[name], (name, g, w)  # the same bits, not just close


@pytest.mark.parametrize("kind", ["torch.save", "raw pickle"])
def test_a_planted_state_file_is_refused_without_running_it(tmp_path, capsys, kind):
    results = tmp_path / "results"
    _crash_at(results, 6)
    state = results / "checkpoints" / "run_id=victim" / "state.pt"
    marker = tmp_path / "code-ran"
    planted = {"format": 2, "round": 4, "run_state": RunsCode(marker), "client_state": {}}
    if kind == "torch.save":
        torch.save(planted, state)
    else:
        state.write_bytes(pickle.dumps(planted))
    before = sorted(p for p in results.rglob("*") if p.is_file())
    code = cli.main(["run", f"results_dir={results}", *RUN, "resume=victim"])
    err = capsys.readouterr().err
    assert not marker.exists()  # the file's code never ran
    assert code == 2 and err.count("\n") == 1 and err.startswith("fedharness: error: invalid value for 'resume'")
    assert f"{state} is not a checkpoint fedharness wrote; refused to load it" in err
    if kind == "torch.save":
        assert "posix.system" in err  # names what the file asked to run
    assert sorted(p for p in results.rglob("*") if p.is_file()) == before  # nothing written


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
    results = tmp_path / "results"
    _crash_at(results, 6)
    torch.save({"format": 1, "round": 4}, results / "checkpoints" / "run_id=victim" / "state.pt")
    with pytest.raises(ConfigError, match="a format-1 checkpoint, this version resumes format 3 only"):
        execute(load_settings([f"results_dir={results}", *RUN, "resume=victim"]))


def test_a_checkpoint_from_before_the_client_store_is_refused_in_one_line(tmp_path, capsys):
    """Format 2 kept every client's state in state.pt, read by the driver: refused, nothing written."""
    results = tmp_path / "results"
    _crash_at(results, 6)
    state = results / "checkpoints" / "run_id=victim" / "state.pt"
    torch.save({"format": 2, "round": 4, "run_state": {}, "client_state": {(0, 1): {"control": torch.zeros(3)}}},
               state)
    before = sorted((p, p.stat().st_mtime_ns) for p in results.rglob("*") if p.is_file())
    assert cli.main(["run", f"results_dir={results}", *RUN, "resume=victim"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid value for 'resume'" in err and "format-2 checkpoint" in err
    assert sorted((p, p.stat().st_mtime_ns) for p in results.rglob("*") if p.is_file()) == before


def test_numpy_values_keep_their_bits():
    from fedharness.core.checkpoint import _decode_array, _encode_array, _map

    state = {(0, 3): {"c": torch.arange(3.0)}, "counters": {"steps": np.array([1, 2**40], np.int64),
             "sim_s": np.array([0.1, 1 / 3]), "half": np.float16(1.5).reshape(()), "u": np.uint8(7)},
             "series": [np.arange(6, dtype=np.float32).reshape(2, 3).T, (1, "x", None)]}
    back = _map(_map(state, _encode_array), _decode_array)
    for key in ("steps", "sim_s", "half"):
        a, b = state["counters"][key], back["counters"][key]
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert type(back["counters"]["u"]) is np.uint8 and back["counters"]["u"] == 7
    np.testing.assert_array_equal(back["series"][0], state["series"][0])  # a transposed (non-contiguous) view
    assert back["series"][1] == (1, "x", None) and torch.equal(back[(0, 3)]["c"], state[(0, 3)]["c"])
