"""Fixed heterogeneous local work: client i always makes tau_i steps (Wang et al.'s quadratic example)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fedharness.contracts import LocalWork
from fedharness.registry.groups import part
from fedharness.keys import Key, _is_int, _is_list

KEYS: dict[str, Key] = {  # harness/config/schema.py's rules add: one entry per client when local_work=per_client
    "client_steps": Key(lambda v: v is None or _is_list(v, lambda s: _is_int(s) and s >= 1),
                        "null or a list of integers >= 1, one per client",
                        "local_work=per_client: each client's fixed tau_i"),
}


@part("local_work", "per_client")
class PerClientSteps(LocalWork):
    """Client k makes client_steps[k] local steps in every round it is sampled."""

    def __init__(self, client_steps: Sequence[int]):
        self.client_steps = np.asarray(client_steps, dtype=np.int64)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return self.client_steps[clients]
