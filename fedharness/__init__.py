"""`import fedharness`: the Python API (harness.api) under the distribution's name."""

from harness import __version__
from harness.api import Result, Study, run, report, sweep, tune
from harness.errors import ConfigError

__all__ = ["ConfigError", "Result", "Study", "__version__", "report", "run", "sweep", "tune"]
