"""Step sizes that a paper's theory prescribes for a setting, as plain functions of its quantities.

Yang, Fang, Liu (ICLR 2021), two-sided step sizes: with K local steps, n clients per round (m under full
participation) and T rounds, the client (local) and server (global) step sizes

    eta_L = c1 / (K sqrt(T)),    eta = c2 sqrt(K n)

give FedAvg the rate O(sqrt(K) / sqrt(n T) + 1/T) with partial participation, O(1 / sqrt(m K T) + 1/T) with
full: linear speedup in n (or m). Their constants are c1 = 1/L and c2 = 1.
"""

from __future__ import annotations

import math


def yang_two_sided(local_steps: int, clients: int, rounds: int, c1: float = 1.0,
                   c2: float = 1.0) -> tuple[float, float]:
    """(eta_L, eta) = (c1 / (K sqrt(T)), c2 sqrt(K n)) for K = local_steps, n = clients, T = rounds."""
    return c1 / (local_steps * math.sqrt(rounds)), c2 * math.sqrt(local_steps * clients)
