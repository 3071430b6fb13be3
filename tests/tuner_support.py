"""Tuner processes for the tests of several workers on one study: they start together and their trials overlap."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# A tuner that waits at a barrier after its imports (under load one process can import torch seconds after the
# other and find a fast study already full) and sleeps 0.5 s before each call of the function it paces (argv[4],
# "module:name": one trial's run, or a batch's), so that the workers claim trials side by side.
_PACED = """
import importlib, pathlib, sys, time
from fedharness import cli
barrier, me, n, (module, name) = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4].split(":")
module = importlib.import_module(module)
(barrier / me).touch()
while len(list(barrier.iterdir())) < n:
    time.sleep(0.05)
unpaced = getattr(module, name)
def paced(*args, **kw):
    time.sleep(0.5)
    return unpaced(*args, **kw)
setattr(module, name, paced)
sys.exit(cli.main(["tune", *sys.argv[5:]]))
"""


def paced_tuners(argsets: list[list[str]], barrier: Path, paced: str) -> list[subprocess.Popen]:
    """One `fedharness tune` process per argument list, all started together, each pacing `paced`
    ("module:name"); their output (stdout and stderr together) through .communicate()."""
    barrier.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", _PACED, str(barrier), str(i), str(len(argsets)), paced, *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i, args in enumerate(argsets)]
