"""A model's buffers in training: the last `buffer_dim` entries of every flat vector (problems/module_state.py).

Local steps do not move them by gradients. The problem's gradient carries, in those entries, the buffers' values
after the step's train-mode forward pass (BatchNorm's running statistics); `take_buffers` takes them out of the
gradient before the solver's update (so momentum, weight decay or a control variate never touch them) and the
executor writes them into the copies after it. Each client's delta then holds b_k - b, so the server's buffers
after a round are b + sum_k c_k (b_k - b): the average weighted by the round's aggregation coefficients (with
FedAvg's, which sum to 1, the weighted mean of the clients' buffers), never moved by a server optimizer.

`model.buffers=local` (FedBN, Li et al. 2021): each client starts a round from its own buffers as it ended its
last one (the server's on its first round), kept in its shard's ClientStore as the slot "buffers" (core/client_store.py), checkpointed
with it. The server still keeps the average above, which evaluating the global model uses.
"""

from __future__ import annotations

import torch

from fedharness.contracts import ClientSlot, ClientState, Problem

STATE_KEY = "buffers"  # a client's own buffers: its slot's name (model.buffers=local)


def buffer_dim(problem: Problem) -> int:
    """How many trailing entries of the problem's flat vectors are buffers (0: none, or no model)."""
    return 0 if problem.objective is None else int(problem.objective.buffer_dim)


def local_buffers(problem: Problem) -> bool:
    """Whether each client keeps its own buffers between rounds (model.buffers=local)."""
    return buffer_dim(problem) > 0 and problem.objective.buffers == "local"


def buffer_slots(problem: Problem) -> tuple[ClientSlot, ...]:
    """FedBN's slot (model.buffers=local): each client's buffers, at its first round the server's."""
    if not local_buffers(problem):
        return ()
    b = buffer_dim(problem)
    return (ClientSlot(STATE_KEY, (b,), problem.dtype, lambda w0, ctx: w0[:, -b:]),)


def take_buffers(g: torch.Tensor, b: int) -> torch.Tensor:
    """The buffers' new values [M, b] out of a gradient [M, dim] whose last b entries hold them; those entries
    of g become 0."""
    new = g[:, -b:].clone()
    g[:, -b:] = 0
    return new


def load_client_buffers(w: torch.Tensor, saved: list[ClientState], b: int) -> None:
    """Each copy's buffers from its client's saved state, where it has some (model.buffers=local), in place."""
    for i, state in enumerate(saved):
        if STATE_KEY in state:
            w[i, -b:] = state[STATE_KEY].to(w.device, w.dtype)


def average_into(x_new: torch.Tensor, x_old: torch.Tensor, delta: torch.Tensor, b: int) -> torch.Tensor:
    """The server's buffers after a round: old + the aggregated delta, whatever the server optimizer did to the
    parameters (x_new's first entries)."""
    x_new[:, -b:] = (x_old[:, -b:].double() + delta[:, -b:]).to(x_new.dtype)
    return x_new
