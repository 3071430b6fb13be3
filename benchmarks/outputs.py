"""Where a benchmark's lines and record go: the lines to stdout, the record (with the load at the end, which says
how busy the machine was) to benchmarks/out/<name>.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

OUT = Path(__file__).parent / "out"


def publish(record: dict, lines: list[str], name: str) -> None:
    record["loadavg_at_end"] = os.getloadavg()
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=2))
