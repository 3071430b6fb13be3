"""A benchmark's measurements in fresh child processes (their own imports, threads and peak memory): the script
runs itself with `--child KIND PAYLOAD` and prints its result as the last line of JSON."""

from __future__ import annotations

import json
import subprocess
import sys


def run_child(script: str, kind: str, payload: dict, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, script, "--child", kind, json.dumps(payload)], capture_output=True,
                         text=True, check=False, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"benchmark child {kind} {payload} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
