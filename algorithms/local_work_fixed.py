"""Fixed heterogeneous local work: client i always makes tau_i steps (Wang et al.'s quadratic example)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fedharness.errors import require


class PerClientSteps:
    """Client k makes client_steps[k] local steps in every round it is sampled."""

    def __init__(self, client_steps: Sequence[int] | None, num_clients: int):
        require(client_steps is not None and len(client_steps) == num_clients, "algorithm.client_steps",
                client_steps, f"a list of {num_clients} integers >= 1 (one per client) when local_work=per_client")
        steps = np.asarray(client_steps)
        require(np.issubdtype(steps.dtype, np.integer) and bool((steps >= 1).all()), "algorithm.client_steps",
                client_steps, "integers >= 1")
        self.client_steps = steps.astype(np.int64)

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        return self.client_steps[clients]
