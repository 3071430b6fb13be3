"""`import fedharness`: a benchmark harness for federated optimization.

The Python API (fedharness.api: run, tune, sweep, report) and the registration calls (fedharness.extend).
The repository's `harness/`, `algorithms/` and `partitions/` folders install as `fedharness`,
`fedharness.algorithms` and `fedharness.partitions` (pyproject.toml's package-dir). The names below load
on first use, so `import fedharness.core.engine` (a Ray worker, the CLI's help) does not import the whole API.
"""

from __future__ import annotations

import logging
from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Library output (warnings, progress notes) goes to loggers under `fedharness`; only the command line shows it
# (fedharness.cli). A program or notebook that wants it configures logging, e.g. logging.basicConfig(level="INFO").
logging.getLogger(__name__).addHandler(logging.NullHandler())

_EXPORTS = {"run": "api", "tune": "api", "sweep": "api", "report": "api", "Result": "api", "Study": "api",
            "ConfigError": "errors", "register_dataset": "extend", "register_model": "extend",
            "register_part": "extend", "register_partitioner": "extend", "register_metric": "extend",
            "register_attack": "extend", "register_stage": "extend", "register_compressor": "extend",
            "register_option": "extend", "Cadence": "contracts",
            "Callback": "contracts", "RoundContext": "contracts", "DataSplit": "contracts",
            "UpdateStage": "contracts", "ClientWork": "contracts", "Compressor": "contracts"}

__all__ = ["__version__", *sorted(_EXPORTS)]

if TYPE_CHECKING:
    from fedharness.api import Result, Study, report, run, sweep, tune
    from fedharness.errors import ConfigError
    from fedharness.contracts import Cadence, Callback, ClientWork, Compressor, DataSplit, RoundContext, UpdateStage
    from fedharness.extend import register_dataset, register_metric, register_model, register_part, register_partitioner
    from fedharness.extend import register_attack, register_compressor, register_option, register_stage


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedharness' has no attribute {name!r}")
    value = getattr(import_module(f"fedharness.{_EXPORTS[name]}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
