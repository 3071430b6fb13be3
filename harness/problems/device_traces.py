"""FedScale's client systems traces (device capacity, availability), read without running any code in them.

FedScale (github.com/SymbioticLab/FedScale) publishes two traces as Python pickles:

* the device trace (`client_device_capacity`): {client_id: {'computation': ms per training sample,
  'communication': bandwidth in kbit/s}}. FedScale times a client's round as batch_size * local_steps *
  computation / 1000 s of compute (it also multiplies by an augmentation factor 3, not applied here) plus
  size_kbit / communication s of transfer;
* the availability trace (`client_behave_trace`): {client_id: {'active': [t0, t1, ...], 'inactive': [e0, e1, ...],
  'finish_time': T, ...}}: the client is online during each [active[i], inactive[i]], ends included, and the
  pattern repeats with period T (time t is read as t mod T). Other keys ('duration', 'model', ...) are ignored.

Safety: loading a pickle can run any code, so these files never reach pickle.load. The reader's find_class refuses
every global, so only plain built-ins come out (dicts, lists, tuples, numbers, strings, ...) and nothing is called;
a numpy number is rebuilt as a plain one by functions of this module (NUMPY_NUMBER: numeric dtypes and raw bytes
only); a pickle that needs any other global (numpy arrays, OrderedDict, any class, os.system) is refused with the
global named.
The same structure is read from JSON (a file whose first non-blank byte is `{`; client ids are then strings);
convert() writes that JSON from a pickle. After loading, the structure is checked: the first problem found is one
ConfigError whose key is speed.file or availability.file and whose value is the path.

Ids and their order: a client id (an int, at most 18 digits, or a string) is kept as a string, str(id). Entries are
sorted by that string: numeric ids (an optional '-' then 1 to 18 digits) first, by integer value (equal values,
such as "7" and "07", by the string), then all other ids in code point order. `ids` of both traces is in this
order, and the mapping from trace entries to a run's clients takes the entries in this order.
"""

from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar, Union

import numpy as np

from fedharness.errors import ConfigError

DEVICE_KEY = "speed.file"
AVAILABILITY_KEY = "availability.file"
EITHER_KEY = f"{DEVICE_KEY} or {AVAILABILITY_KEY}"  # convert(): the file's kind is known only once it is read
_NUMERIC_ID = re.compile(r"-?[0-9]{1,18}")  # [0-9], not \d: int() must read it; 18 digits fit int64
_MAX_INT_ID = 10**18
_NUMBER = (int, float)  # exact types: bool (an int subclass) is no number here
_NUMBER_TYPES = frozenset(_NUMBER)


class _Bad(Exception):
    """A problem with a trace's content, in words; the caller adds the key and the path."""


def _freeze(*arrays: np.ndarray) -> None:
    for array in arrays:
        array.setflags(write=False)  # frozen dataclass: its arrays are read-only too


@dataclass(frozen=True, eq=False)
class DeviceTrace:
    """FedScale's device capacity trace, one entry per client, in the module's id order."""

    ids: np.ndarray  # [M] str
    ms_per_sample: np.ndarray  # [M] float64: FedScale's 'computation'
    kbit_per_s: np.ndarray  # [M] float64: FedScale's 'communication'

    def __post_init__(self) -> None:
        _freeze(self.ids, self.ms_per_sample, self.kbit_per_s)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, eq=False)
class AvailabilityTrace:
    """FedScale's availability trace: per entry, sorted disjoint [start, end] online intervals within one period."""

    ids: np.ndarray  # [M] str
    period_s: np.ndarray  # [M] float64: FedScale's 'finish_time'
    offsets: np.ndarray  # [M+1] int64: entry m's intervals are starts[offsets[m]:offsets[m+1]], same for ends
    starts: np.ndarray  # [I] float64: 'active'
    ends: np.ndarray  # [I] float64: 'inactive'

    def __post_init__(self) -> None:
        _freeze(self.ids, self.period_s, self.offsets, self.starts, self.ends)

    def __len__(self) -> int:
        return len(self.ids)

    def online(self, entry: np.ndarray, t: np.ndarray) -> np.ndarray:
        """bool, shape of np.broadcast(entry, t): whether entry `entry` (an index into ids) is online at time t
        (seconds, >= 0), that is t mod period_s[entry] lies in one of its [start, end] intervals, ends included.
        An entry without intervals is never online. Vectorized over all (entry, t) pairs at once."""
        entry, t = np.broadcast_arrays(np.asarray(entry), np.asarray(t, dtype=np.float64))
        if entry.dtype.kind not in "iu":
            raise TypeError(f"entry must be integer indices into ids, got dtype {entry.dtype}")
        if entry.size and (entry.min() < 0 or entry.max() >= len(self)):
            raise IndexError(f"entry out of range [0, {len(self)})")
        if not len(self.starts):
            return np.zeros(entry.shape, dtype=bool)
        phase = np.mod(t, self.period_s[entry])  # as Python's %, FedScale's rule
        first = self.offsets[entry]
        last = _bisect_right(self.starts, first, self.offsets[entry + 1], phase) - 1  # last start <= phase
        # Intervals are disjoint and sorted, so only the last one starting at or before phase can hold it.
        has = last >= first
        return has & (self.ends[np.where(has, last, 0)] >= phase)


_Trace = TypeVar("_Trace", DeviceTrace, AvailabilityTrace)


def _bisect_right(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Per lane, bisect.bisect_right(values, x, lo, hi) over sorted values[lo:hi]: all lanes at once, in
    log2(longest hi - lo) vector steps. Exact: adding per-entry shifts to float times (one global searchsorted)
    could round a time onto a neighbouring interval's endpoint."""
    lo, hi = lo.copy(), hi.copy()
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        right = open_ & (values[np.where(open_, mid, 0)] <= x)
        lo, hi = np.where(right, mid + 1, lo), np.where(open_ & ~right, mid, hi)


def read_device_trace(path: Union[str, Path]) -> DeviceTrace:
    """The device trace at `path` (FedScale's pickle or its JSON form); ConfigError(speed.file, path)."""
    path = Path(path)
    return _build(_device_from, _load_plain(path, DEVICE_KEY), path, DEVICE_KEY)


def read_availability_trace(path: Union[str, Path]) -> AvailabilityTrace:
    """The availability trace at `path` (pickle or JSON); ConfigError(availability.file, path)."""
    path = Path(path)
    return _build(_availability_from, _load_plain(path, AVAILABILITY_KEY), path, AVAILABILITY_KEY)


def convert(src: Union[str, Path], dst: Union[str, Path]) -> None:
    """Write the trace at `src` (either kind, told apart by its first entry's keys) to `dst` as JSON: ids as
    strings, only the fields read here. Checked like read_*; written to a temporary name, then renamed."""
    src, dst = Path(src), Path(dst)
    data = _load_plain(src, EITHER_KEY)
    first = next(iter(data.values()), None) if isinstance(data, dict) else None
    is_availability = isinstance(first, dict) and not {"active", "inactive", "finish_time"}.isdisjoint(first)
    trace: Union[DeviceTrace, AvailabilityTrace] = (
        _build(_availability_from, data, src, AVAILABILITY_KEY) if is_availability
        else _build(_device_from, data, src, DEVICE_KEY))
    _write_json(dst, _json_form(trace))


def _numeric_dtype(name: Any, align: Any = False, copy: Any = True) -> np.dtype:
    """numpy.dtype as a pickle of a numpy number names it: numeric kinds only (no object dtype)."""
    dtype = np.dtype(name) if isinstance(name, str) else None
    if dtype is None or dtype.kind not in "biuf":
        raise _Bad(f"a numpy number of dtype {name!r} (numeric dtypes only)")
    return dtype


def _numeric_scalar(dtype: Any, data: Any = b"") -> float | int | bool:
    """numpy's scalar(dtype, raw bytes) as the plain Python number it holds."""
    if not isinstance(dtype, np.dtype) or dtype.kind not in "biuf" or not isinstance(data, bytes):
        raise _Bad("a numpy number built from a numeric dtype and its bytes")
    return np.frombuffer(data, dtype=dtype, count=1)[0].item()


def _latin1_bytes(text: Any, encoding: Any = "latin1") -> bytes:
    """_codecs.encode, as protocols 0-2 pickle a numpy number's raw bytes."""
    if not isinstance(text, str) or encoding != "latin1":
        raise _Bad("bytes pickled as latin-1 text")
    return text.encode("latin1")


# The globals a pickled numpy number names (numpy 1 and 2), each answered by a function above.
NUMPY_NUMBER = {("numpy", "dtype"): _numeric_dtype, ("numpy.core.multiarray", "scalar"): _numeric_scalar,
                ("numpy._core.multiarray", "scalar"): _numeric_scalar, ("_codecs", "encode"): _latin1_bytes}


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain built-in values only: every global is refused, so no class is made and nothing is called."""

    def __init__(self, data: bytes, key: str, path: Path):
        super().__init__(io.BytesIO(data))
        self._key, self._path = key, path

    def find_class(self, module: str, name: str) -> Any:
        # Every class and callable (GLOBAL, STACK_GLOBAL, INST, EXT*; REDUCE and NEWOBJ call what these gave)
        # comes through here: refusing them all leaves only the opcodes that build plain values. The one exception
        # is a numpy number (traces written from numpy arithmetic hold them): rebuilt here as a plain float or int
        # by functions of our own that accept numeric dtypes and raw bytes only.
        if (module, name) in NUMPY_NUMBER:
            return NUMPY_NUMBER[(module, name)]
        if not all(part.isidentifier() for part in f"{module}.{name}".split(".")):
            # Text read as a pickle: its first letter 'c' is the GLOBAL opcode (a CSV file, say).
            raise ConfigError(self._key, str(self._path), "not a pickle or JSON file")
        hint = "; numpy arrays need one: save lists, or JSON" if module.split(".")[0] == "numpy" else ""
        raise ConfigError(self._key, str(self._path),
                          f"a pickle of plain dicts, lists, numbers and strings: it names the global {module}.{name}"
                          f"{hint}")

    def persistent_load(self, pid: Any) -> Any:
        raise ConfigError(self._key, str(self._path), "a pickle of plain dicts, lists, numbers and strings: "
                                                      "it holds a persistent id")


def _load_plain(path: Path, key: str) -> Any:
    """The file's content as plain values: JSON if its first non-blank byte is '{', else a restricted pickle."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(key, str(path), "file not found") from None
    except OSError as err:
        raise ConfigError(key, str(path), f"cannot be read: {err.strerror or err}") from None
    if data.lstrip()[:1] == b"{":
        return _load_json(data, key, path)
    try:
        return _PlainUnpickler(data, key, path).load()
    except ConfigError:
        raise
    except _Bad as err:  # a numpy global used for something other than a number
        raise ConfigError(key, str(path), f"a pickle of plain dicts, lists, numbers and strings: {err}") from None
    except Exception as err:  # truncated or no pickle at all: the unpickler raises many kinds of error
        raise ConfigError(key, str(path), f"not a pickle or JSON file ({type(err).__name__}: {err})") from None


def _load_json(data: bytes, key: str, path: Path) -> Any:
    try:
        return json.loads(data, object_pairs_hook=_unique_keys)
    except _Bad as err:
        raise ConfigError(key, str(path), f"a JSON trace: {err}") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise ConfigError(key, str(path), f"not a pickle or JSON file ({err})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object; a repeated key (json would keep the last silently: a client listed twice) is refused."""
    out = dict(pairs)
    if len(out) < len(pairs):
        counts = collections.Counter(k for k, _ in pairs)
        raise _Bad(f"key {next(k for k, n in counts.items() if n > 1)!r} appears twice in one object")
    return out


def _build(build: Callable[[Any], _Trace], data: Any, path: Path, key: str) -> _Trace:
    """build(data), a trace from plain values; a problem in them is one ConfigError naming the key and path."""
    try:
        return build(data)
    except _Bad as err:
        kind = "device" if key == DEVICE_KEY else "availability"
        raise ConfigError(key, str(path), f"a FedScale {kind} trace: {err}") from None


def _sort_key(cid: str) -> tuple[int, int, str]:
    return (0, int(cid), cid) if _NUMERIC_ID.fullmatch(cid) else (1, 0, cid)


def _entries(data: Any) -> list[tuple[str, dict]]:
    """(id as a string, the client's dict) for every client, in the module's id order."""
    if not isinstance(data, dict):
        raise _Bad(f"a dict from client id to client at the top, not a {type(data).__name__}")
    if not data:
        raise _Bad("empty trace: no clients")
    entries: dict[str, dict] = {}
    for cid, value in data.items():
        if type(cid) not in (int, str) or (type(cid) is int and abs(cid) >= _MAX_INT_ID):
            raise _Bad(f"client id {reprlib.repr(cid)} is no string or int of at most 18 digits")
        if str(cid) in entries:
            raise _Bad(f"client id {cid} appears twice (as an int and as a string)")
        if not isinstance(value, dict):
            raise _Bad(f"client {cid}'s entry is a {type(value).__name__}, not a dict")
        entries[str(cid)] = value
    return sorted(entries.items(), key=lambda item: _sort_key(item[0]))


def _ids(entries: list[tuple[str, dict]]) -> np.ndarray:
    return np.array([cid for cid, _ in entries], dtype=str)


def _number(entry: dict, field: str, cid: str) -> float:
    """entry[field] as a finite float; bools and strings are no numbers."""
    if field not in entry:
        raise _Bad(f"client {cid} has no {field!r} key")
    value = entry[field]
    if type(value) not in _NUMBER:
        raise _Bad(f"client {cid}'s {field!r} is {reprlib.repr(value)}, not a number")
    if type(value) is int and abs(value) > 2**1023:
        raise _Bad(f"client {cid}'s {field!r} is too large")  # float() would overflow
    if not math.isfinite(value):
        raise _Bad(f"client {cid}'s {field!r} is {value}, not finite")
    return float(value)


def _positive(entry: dict, field: str, cid: str) -> float:
    value = _number(entry, field, cid)
    if value <= 0:
        raise _Bad(f"client {cid}'s {field!r} is {value}, not positive")
    return value


def _device_from(data: Any) -> DeviceTrace:
    entries = _entries(data)
    speeds = np.empty((2, len(entries)))
    for m, (cid, entry) in enumerate(entries):
        speeds[:, m] = _positive(entry, "computation", cid), _positive(entry, "communication", cid)
    return DeviceTrace(_ids(entries), speeds[0].copy(), speeds[1].copy())


def _times(entry: dict, field: str, cid: str) -> list[float]:
    """entry[field], a list of numbers, as floats (finiteness is checked later, with the intervals)."""
    if field not in entry:
        raise _Bad(f"client {cid} has no {field!r} key")
    times = entry[field]
    if type(times) not in (list, tuple):
        raise _Bad(f"client {cid}'s {field!r} is a {type(times).__name__}, not a list")
    if set(map(type, times)) <= _NUMBER_TYPES:  # the common case, at C speed: millions of times
        try:
            return list(map(float, times))
        except OverflowError:
            raise _Bad(f"client {cid}'s {field!r} holds an int too large for a float") from None
    for i, value in enumerate(times):  # a per-element loop only to name the first bad element
        if type(value) not in _NUMBER:
            raise _Bad(f"client {cid}'s {field!r}[{i}] is {reprlib.repr(value)}, not a number")
    raise AssertionError("unreachable: some element is no number")


def _availability_from(data: Any) -> AvailabilityTrace:
    entries = _entries(data)
    periods, starts, ends = np.empty(len(entries)), [], []
    offsets = np.zeros(len(entries) + 1, dtype=np.int64)
    for m, (cid, entry) in enumerate(entries):
        periods[m] = _positive(entry, "finish_time", cid)
        active, inactive = _times(entry, "active", cid), _times(entry, "inactive", cid)
        if len(active) != len(inactive):
            raise _Bad(f"client {cid} has {len(active)} 'active' times but {len(inactive)} 'inactive' times")
        starts += active
        ends += inactive
        offsets[m + 1] = offsets[m] + len(active)
    trace = AvailabilityTrace(_ids(entries), periods, offsets, np.array(starts, dtype=np.float64),
                              np.array(ends, dtype=np.float64))
    _check_intervals(trace)
    return trace


def _check_intervals(trace: AvailabilityTrace) -> None:
    """Raise _Bad for the first interval (in id order) that breaks the rules online() relies on: finite, start <=
    end, within [0, finish_time], and starting at or after its client's previous interval ends."""
    s, e = trace.starts, trace.ends
    owner = np.repeat(np.arange(len(trace)), np.diff(trace.offsets))
    previous_end = np.concatenate([[-np.inf], e[:-1]])
    previous_end[trace.offsets[:-1][trace.offsets[:-1] < len(s)]] = -np.inf  # a client's first interval
    with np.errstate(invalid="ignore"):
        bad = (~np.isfinite(s) | ~np.isfinite(e) | (e < s) | (s < 0) | (e > trace.period_s[owner])
               | (s < previous_end))
    if bad.any():
        k = int(np.argmax(bad))
        m = int(owner[k])
        raise _Bad(_interval_problem(str(trace.ids[m]), k - int(trace.offsets[m]), float(s[k]), float(e[k]),
                                     float(previous_end[k]), float(trace.period_s[m])))


def _interval_problem(cid: str, i: int, start: float, end: float, previous_end: float, period: float) -> str:
    """What is wrong with client cid's interval i (0-based), which _check_intervals found bad."""
    where = f"client {cid}'s interval {i}"
    if not (math.isfinite(start) and math.isfinite(end)):
        return f"{where} is [{start}, {end}], not finite"
    if end < start:
        return f"{where} ends ({end}) before it starts ({start})"
    if start < 0:
        return f"{where} starts ({start}) before time 0"
    if end > period:
        return f"{where} ends ({end}) after finish_time ({period}): intervals lie within one period"
    return f"{where} starts ({start}) before interval {i - 1} ends ({previous_end}): intervals must be sorted " \
           f"and must not overlap"


def _json_form(trace: Union[DeviceTrace, AvailabilityTrace]) -> dict[str, dict[str, Any]]:
    """The trace as FedScale's structure of plain values, ids as strings, in id order."""
    ids = trace.ids.tolist()
    if isinstance(trace, DeviceTrace):
        return {cid: {"computation": c, "communication": b}
                for cid, c, b in zip(ids, trace.ms_per_sample.tolist(), trace.kbit_per_s.tolist())}
    bounds, starts, ends = trace.offsets.tolist(), trace.starts.tolist(), trace.ends.tolist()
    return {cid: {"active": starts[a:b], "inactive": ends[a:b], "finish_time": period}
            for cid, a, b, period in zip(ids, bounds[:-1], bounds[1:], trace.period_s.tolist())}


def _write_json(dst: Path, payload: dict[str, dict[str, Any]]) -> None:
    """Write payload to dst atomically: a reader never sees half a file, a failed write leaves dst as it was."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump(payload, out, allow_nan=False)  # floats as repr: read back exactly
            out.write("\n")
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


__all__ = ["AVAILABILITY_KEY", "AvailabilityTrace", "DEVICE_KEY", "DeviceTrace", "convert",
           "read_availability_trace", "read_device_trace"]
