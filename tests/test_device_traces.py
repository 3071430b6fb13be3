"""FedScale's systems traces (problems/device_traces.py): values read back exactly from pickles and JSON, the id
order, online() equal to FedScale's rule in a plain loop, every malformed file one ConfigError naming the key and
the path, pickles needing a global refused without running anything, convert() round trips."""

from __future__ import annotations

import collections
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedharness.errors import ConfigError
from fedharness.problems.device_traces import (AVAILABILITY_KEY, DEVICE_KEY, EITHER_KEY, AvailabilityTrace,
                                               convert, read_availability_trace, read_device_trace)

DEVICE = {432802: {"computation": 162.0, "communication": 5648.109619499134},
          7: {"computation": 3, "communication": 0.5},
          "10": {"computation": 1e-3, "communication": 12.25}, "pixel": {"computation": 20.5, "communication": 1e6}}
AVAILABILITY = {
    17: {"active": [0, 10, 50], "inactive": [5, 20, 100], "finish_time": 100, "duration": 100, "model": "SM-G9"},
    3: {"active": [2.5], "inactive": [2.5], "finish_time": 7.25},  # one instant per period
    "4": {"active": [], "inactive": [], "finish_time": 60},  # never online
    "b": {"active": [1, 5], "inactive": [5, 9], "finish_time": 9},  # touching intervals, one ending at the period
}


def write(tmp_path: Path, data: Any, name: str = "trace.pkl") -> Path:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data)) if name.endswith(".pkl") else path.write_text(json.dumps(data))
    return path


def test_device_values_read_back_exactly(tmp_path):
    for name in ("trace.pkl", "trace.json"):
        trace = read_device_trace(write(tmp_path, DEVICE, name))
        assert len(trace) == 4 and trace.ids.tolist() == ["7", "10", "432802", "pixel"]
        assert trace.ms_per_sample.tolist() == [3.0, 1e-3, 162.0, 20.5]
        assert trace.kbit_per_s.tolist() == [0.5, 12.25, 5648.109619499134, 1e6]
        assert trace.ms_per_sample.dtype == np.float64 and not trace.kbit_per_s.flags.writeable


def test_availability_values_read_back_exactly(tmp_path):
    trace = read_availability_trace(write(tmp_path, AVAILABILITY))  # 'duration' and 'model' are ignored
    assert trace.ids.tolist() == ["3", "4", "17", "b"] and len(trace) == 4
    assert trace.period_s.tolist() == [7.25, 60.0, 100.0, 9.0]
    assert trace.offsets.tolist() == [0, 1, 1, 4, 6] and trace.offsets.dtype == np.int64
    assert trace.starts.tolist() == [2.5, 0, 10, 50, 1, 5] and trace.ends.tolist() == [2.5, 5, 20, 100, 5, 9]


def test_id_order_numeric_then_strings(tmp_path):
    ids = ["b", 12, "-3", "007", "7", 10**17, "A", "1e3", "", "x7", -20]
    data = {cid: {"computation": 1.0, "communication": 1.0} for cid in ids}
    expected = ["-20", "-3", "007", "7", "12", str(10**17), "", "1e3", "A", "b", "x7"]
    assert read_device_trace(write(tmp_path, data)).ids.tolist() == expected


def fedscale_online(trace: dict, t: float) -> bool:
    """FedScale's isActive without its cursor: t mod finish_time within some [active[i], inactive[i]]."""
    norm = t % trace["finish_time"]
    return any(a <= norm <= b for a, b in zip(trace["active"], trace["inactive"]))


def random_trace(rng: random.Random, clients: int) -> dict:
    out: dict[Any, dict] = {}
    for c in range(clients):
        period = rng.choice([rng.randint(5, 200), rng.uniform(1.0, 50.0)])
        cuts = sorted(rng.choice([rng.randint(0, int(period)), rng.uniform(0, period)])
                      for _ in range(2 * rng.randint(0, 6)))  # some equal: zero-length and touching intervals
        out[100 + c * 7 % clients] = {"active": cuts[0::2], "inactive": cuts[1::2], "finish_time": period}
    return out


def test_online_equals_fedscale_rule(tmp_path):
    rng = random.Random(0)
    data = random_trace(rng, 40) | AVAILABILITY
    trace = read_availability_trace(write(tmp_path, data))
    entries, times = [], []
    by_id = {str(cid): client for cid, client in data.items()}
    for m, cid in enumerate(trace.ids.tolist()):
        client = by_id[cid]
        points = client["active"] + client["inactive"] + [0.0, client["finish_time"]]
        for p in points:  # endpoints, just off them, and the same a few periods later
            for k in (0, 1, 3, 1000):
                for d in (0.0, -1e-9, 1e-9, 0.5):
                    entries.append(m), times.append(max(p + d, 0.0) + k * client["finish_time"])
        for _ in range(50):
            entries.append(m), times.append(rng.uniform(0, 5 * client["finish_time"]))
    got = trace.online(np.array(entries), np.array(times))
    expected = [fedscale_online(by_id[trace.ids[m]], t) for m, t in zip(entries, times)]
    assert got.dtype == bool and got.tolist() == expected
    assert 0.2 < np.mean(expected) < 0.8  # both answers well represented


def test_online_broadcasts_and_checks_entries(tmp_path):
    trace = read_availability_trace(write(tmp_path, AVAILABILITY))
    assert trace.online(2, 12.0).shape == () and bool(trace.online(2, 112.0))  # client 17, second period
    # "b" (period 9): 9 and 100 are 0 and 1 mod 9
    grid = trace.online(np.arange(4)[:, None], np.array([0.0, 2.5, 5.0, 9.0, 100.0]))
    assert grid.tolist() == [[False, True, False, False, False], [False] * 5,
                             [True, True, True, False, True], [False, True, True, False, True]]
    with pytest.raises(IndexError):
        trace.online(np.array([4]), 0.0)
    with pytest.raises(TypeError):
        trace.online(np.array([0.5]), 0.0)
    empty = read_availability_trace(write(tmp_path, {1: {"active": [], "inactive": [], "finish_time": 1}}))
    assert not empty.online(np.zeros(3, dtype=int), np.arange(3.0)).any()


def avail(**client: Any) -> dict:
    return {17: {"active": [0, 10], "inactive": [5, 20], "finish_time": 100} | client}


BAD_AVAILABILITY = [
    ({17: {"active": [0, 10, 20, 9], "inactive": [5, 15, 30, 5.0], "finish_time": 100}},
     "a FedScale availability trace: client 17's interval 3 ends (5.0) before it starts (9.0)"),
    (avail(active=[0, 4]),
     "client 17's interval 1 starts (4.0) before interval 0 ends (5.0): intervals must be sorted and must not overlap"),
    (avail(active=[10, 0], inactive=[20, 5]), "interval 1 starts (0.0) before interval 0 ends (20.0)"),
    (avail(inactive=[5, 101]), "client 17's interval 1 ends (101.0) after finish_time (100.0)"),
    (avail(active=[-1, 10]), "client 17's interval 0 starts (-1.0) before time 0"),
    (avail(inactive=[5, float("nan")]), "client 17's interval 1 is [10.0, nan], not finite"),
    (avail(finish_time=0), "client 17's 'finish_time' is 0.0, not positive"),
    (avail(finish_time=-3.5), "client 17's 'finish_time' is -3.5, not positive"),
    (avail(inactive=[5]), "client 17 has 2 'active' times but 1 'inactive' times"),
    (avail(active="0,10"), "client 17's 'active' is a str, not a list"),
    (avail(active=[0, "10"]), "client 17's 'active'[1] is '10', not a number"),
    (avail(active=[0, True]), "client 17's 'active'[1] is True, not a number"),
    (avail(inactive=[5, 10**400]), "client 17's 'inactive' holds an int too large for a float"),
    ({17: {"active": [], "inactive": []}}, "client 17 has no 'finish_time' key"),
    ({}, "a FedScale availability trace: empty trace: no clients"),
    ([1, 2], "a dict from client id to client at the top, not a list"),
]


@pytest.mark.parametrize("data, why", BAD_AVAILABILITY, ids=range(len(BAD_AVAILABILITY)))
def test_bad_availability_one_config_error(tmp_path, data, why):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        read_availability_trace(path)
    assert err.value.key == AVAILABILITY_KEY and err.value.value == str(path) and why in err.value.allowed
    assert str(err.value).startswith(f"invalid value for '{AVAILABILITY_KEY}': '{path}' (")


BAD_DEVICE = [
    ({1: {"communication": 5.0}}, "a FedScale device trace: client 1 has no 'computation' key"),
    ({1: {"computation": 5.0, "communication": 0}}, "client 1's 'communication' is 0.0, not positive"),
    ({1: {"computation": -2, "communication": 1}}, "client 1's 'computation' is -2.0, not positive"),
    ({1: {"computation": "5", "communication": 1}}, "client 1's 'computation' is '5', not a number"),
    ({1: {"computation": float("inf"), "communication": 1}}, "client 1's 'computation' is inf, not finite"),
    ({1: {"computation": 10**400, "communication": 1}}, "client 1's 'computation' is too large"),
    ({1: [5.0, 1.0]}, "client 1's entry is a list, not a dict"),
    ({1.5: {"computation": 1, "communication": 1}}, "client id 1.5 is no string or int of at most 18 digits"),
    ({1: {"computation": 1, "communication": 1}, "1": {"computation": 2, "communication": 1}},
     "client id 1 appears twice (as an int and as a string)"),
    ({}, "a FedScale device trace: empty trace: no clients"),
]


@pytest.mark.parametrize("data, why", BAD_DEVICE, ids=range(len(BAD_DEVICE)))
def test_bad_device_one_config_error(tmp_path, data, why):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        read_device_trace(path)
    assert err.value.key == DEVICE_KEY and err.value.value == str(path) and why in err.value.allowed


class Speed:
    """Any class instance needs a global to unpickle."""

    def __init__(self) -> None:
        self.computation = 1.0


class Payload:
    """Unpickling this would run a shell command that creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def refused(path: Path, reader=read_device_trace, key: str = DEVICE_KEY) -> str:
    with pytest.raises(ConfigError) as err:
        reader(path)
    assert err.value.key == key and err.value.value == str(path)
    return err.value.allowed


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_numpy_numbers_read_as_plain_numbers_and_arrays_refused(tmp_path, protocol):
    """Traces written from numpy arithmetic hold numpy numbers: rebuilt as plain numbers from their dtype and bytes
    (numeric dtypes only), never by numpy's own unpickling; an array is still refused, naming its global."""
    path = tmp_path / "numbers.pkl"
    devices = {1: {"computation": np.float64(2.5), "communication": np.float32(0.1)},
               2: {"computation": np.int64(7), "communication": 3.0}}
    path.write_bytes(pickle.dumps(devices, protocol=protocol))
    trace = read_device_trace(path)
    assert trace.ms_per_sample.tolist() == [2.5, 7.0]
    assert trace.kbit_per_s.tolist() == [float(np.float32(0.1)), 3.0]
    path.write_bytes(pickle.dumps({1: {"active": np.array([0, 1]), "inactive": [1, 2], "finish_time": 5}},
                                  protocol=protocol))
    why = refused(path, read_availability_trace, AVAILABILITY_KEY)
    assert "it names the global numpy" in why and "save lists, or JSON" in why


def test_a_numpy_number_of_object_dtype_is_refused(tmp_path):
    path = tmp_path / "object.pkl"  # numpy.dtype('O8'): the dtype whose scalars would hold any object
    path.write_bytes(b"cnumpy\ndtype\n(S'O8'\nI00\nI01\ntR.")
    assert "numeric dtypes only" in refused(path)


@pytest.mark.parametrize("value, name", [(collections.OrderedDict(a=1), "collections.OrderedDict"),
                                         (Speed(), "test_device_traces.Speed"), (1 + 2j, "builtins.complex")])
def test_class_instances_refused(tmp_path, value, name):
    path = write(tmp_path, {1: {"computation": value, "communication": 3.0}})
    why = refused(path)
    assert why.startswith("a pickle of plain dicts, lists, numbers and strings: it names the global") and name in why
    for protocol in (0, 1, 2):  # older protocols reach globals through other opcodes (GLOBAL, INST, copy_reg)
        path.write_bytes(pickle.dumps({1: {"computation": value, "communication": 3.0}}, protocol=protocol))
        assert "it names the global" in refused(path)


def test_plain_built_ins_outside_the_structure_refused(tmp_path):
    # Sets, bytes and None need no global: they load, and the structure check refuses them.
    for value, shown in (({1, 2}, "{1, 2}"), (b"5", "b'5'"), (None, "None")):
        why = refused(write(tmp_path, {1: {"computation": value, "communication": 3.0}}))
        assert why == f"a FedScale device trace: client 1's 'computation' is {shown}, not a number"


def test_reduce_to_os_system_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = write(tmp_path, {1: {"computation": Payload(marker), "communication": 3.0}})
    assert "it names the global posix.system" in refused(path) and not marker.exists()
    hand_made = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()  # protocol 0, as exploit write-ups spell it
    path.write_bytes(hand_made)
    assert "it names the global os.system" in refused(path, read_availability_trace, AVAILABILITY_KEY)
    with pytest.raises(ConfigError):
        convert(path, tmp_path / "out.json")
    assert not marker.exists() and not (tmp_path / "out.json").exists()
    assert pickle.loads(pickle.dumps(Payload(marker))) == 0 and marker.exists()  # the payload is real


def test_persistent_ids_refused(tmp_path):
    path = tmp_path / "trace.pkl"
    path.write_bytes(b"\x80\x02}q\x00K\x01Pabc\nq\x01s.")  # {1: persistent_load('abc')}
    assert "it holds a persistent id" in refused(path)


@pytest.mark.parametrize("content, why", [
    (None, "file not found"),
    (b"", "not a pickle or JSON file (EOFError"),
    (b"computation,communication\n1,2\n", "not a pickle or JSON file"),
    (pickle.dumps(DEVICE)[:-20], "not a pickle or JSON file"),
    (b'  {"1": {"computation": 1, "communication": 2}', "not a pickle or JSON file (Expecting"),
    (b'{"1": {"computation": 1, "communication": 2}, "1": {}}', "a JSON trace: key '1' appears twice in one object"),
])
def test_unreadable_files(tmp_path, content, why):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_bytes(content)
    assert why in refused(path)


@pytest.mark.parametrize("data, reader", [(DEVICE, read_device_trace), (AVAILABILITY, read_availability_trace),
                                          (random_trace(random.Random(1), 30), read_availability_trace)])
def test_convert_round_trips(tmp_path, data, reader):
    src, dst = write(tmp_path, data), tmp_path / "out" / "trace.json"
    dst.parent.mkdir()
    convert(src, dst)
    assert sorted(p.name for p in dst.parent.iterdir()) == ["trace.json"]  # no temporary file left
    assert all(isinstance(key, str) for key in json.loads(dst.read_text()))
    original, converted = reader(src), reader(dst)
    for field in ("ids", "ms_per_sample", "kbit_per_s", "period_s", "offsets", "starts", "ends"):
        if hasattr(original, field):
            np.testing.assert_array_equal(getattr(converted, field), getattr(original, field), strict=True)
    convert(dst, dst)  # JSON in, JSON out, over itself
    assert isinstance(reader(dst), AvailabilityTrace) == (reader is read_availability_trace)


def test_convert_errors_name_the_kind_found(tmp_path):
    with pytest.raises(ConfigError) as err:
        convert(tmp_path / "missing.pkl", tmp_path / "out.json")
    assert err.value.key == EITHER_KEY and err.value.allowed == "file not found"
    with pytest.raises(ConfigError) as err:
        convert(write(tmp_path, avail(inactive=[5, 101])), tmp_path / "out.json")
    assert err.value.key == AVAILABILITY_KEY and not (tmp_path / "out.json").exists()
