"""`import fedharness`: the Python API (harness.api) and the registration calls (harness.extend)."""

from harness import __version__
from harness.api import Result, Study, run, report, sweep, tune
from harness.errors import ConfigError
from harness.extend import register_dataset, register_model, register_part, register_partitioner

__all__ = ["ConfigError", "Result", "Study", "__version__", "register_dataset", "register_model", "register_part",
           "register_partitioner", "report", "run", "sweep", "tune"]
