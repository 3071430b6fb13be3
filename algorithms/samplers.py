"""Client samplers: who takes part in a round and with which aggregation weight q_k.

A selection is a multiset per replica: with-replacement schemes may draw a client
twice, and each draw counts (Li et al. scheme I, Yang et al. strategy 1); the
executor sums the weights of duplicate draws. Draws come from the counter-based
streams keyed by (seed, replica, round) (dropout: also by client), so they do not
depend on the executor, the shard layout or a resume.

The server applies Delta = sum_k weights_k * Delta_k, so a scheme's formula for
the new model w = sum_k q_k w_k becomes weights on the deltas:
  full          q_k = p_k                       (sum 1)
  scheme I      K draws by p_k with replacement, q_k = 1/K
  scheme II     K uniform without replacement, q_k = p_k N / K (sum is random)
  transformed   K uniform without replacement, q_k = 1/K, client lr times N p_k
  original      K uniform without replacement, q_k = p_k: w = sum_{k not in S} p_k w_old
                + sum_{k in S} p_k w_k (McMahan et al.; biased, see docs/algorithms.md)
  yang_s1       K uniform draws with replacement, q_k = 1/K
  yang_s2       K uniform without replacement, q_k = 1/K
  poisson       each client with probability K/N, q_k = 1/K (fixed denominator; a sample of random size)

With the systems clock (harness/core/clock.py) a sampler may take `online`, who is online at the round's start,
and prefer them: the built-in partial samplers draw as before and take the online clients first, in the order
drawn (uniformly among the online ones); when fewer than K are online among MAX_DRAWS_PER_CLIENT K draws, the rest
of the sample is offline clients, who drop out. Poisson takes only online clients; full participation takes every
client, the offline ones dropping out.
"""

from __future__ import annotations

import numpy as np

from fedharness.contracts import Online, Sampler, Selection
from fedharness.registry.groups import part, part_names
from fedharness.base import streams
from fedharness.keys import Key, choice, integer, number
from fedharness.problems.population import draw_by_weight

KEYS: dict[str, Key] = {
    "sampler": choice("which clients a round samples, and their weights", part_names("sampler")),
    "clients_per_round": integer("K, clients sampled per round", lo=1),
    "dropout": number("probability a sampled client does not return", lo=0, hi=1, hi_open=True),
}


# Up to this many clients, K without replacement are the first K of a shuffle of all N (O(N) a round, the
# historical draw, kept so small runs keep their trajectories); above it, the first K distinct of a stream of
# uniform draws (O(K) a round: a uniformly random K-subset in random order either way).
SHUFFLE_MAX_CLIENTS = 1 << 16
# A sampler that prefers online clients draws at most this many times K before it settles for those it found.
MAX_DRAWS_PER_CLIENT = 64


def _uniforms(seed: int, replicas: np.ndarray, rnd: int, count: int) -> np.ndarray:
    return streams.uniform(streams.stream_key(seed, streams.SAMPLE, replicas, rnd, 0), count)


def _distinct_uniform(seed: int, replica: int, rnd: int, K: int, N: int, online: Online | None = None) -> np.ndarray:
    """The first K distinct clients of a stream of uniform draws from 0..N-1 (counter-based, so drawing more
    only extends the same sequence; 2K draws nearly always suffice when K << N). `online` (one row): the first K
    distinct online ones, then offline ones if too few are online."""
    key = streams.stream_key(seed, streams.SAMPLE, replica, rnd, 1)
    count = 2 * K
    while True:
        draws = streams.integers(key, count, N)
        _, first = np.unique(draws, return_index=True)
        if len(first) >= K and online is None:
            return draws[np.sort(first)[:K]]
        if len(first) >= K or len(first) == N:
            distinct = draws[np.sort(first)]
            found = online.mask(distinct[None, :])[0]
            if found.sum() >= K or count >= MAX_DRAWS_PER_CLIENT * K or len(first) == N:
                return np.concatenate([distinct[found], distinct[~found]])[:K]
        count *= 2


def _online_first(candidates: np.ndarray, online: Online | None, K: int) -> np.ndarray:
    """[R, K]: each row's first K candidates, the online ones first (each group in the candidates' order)."""
    if online is None:
        return candidates[:, :K]
    order = np.argsort(~online.mask(candidates), axis=1, kind="stable")[:, :K]
    return np.take_along_axis(candidates, order, axis=1)


def _online_draws(draw, online: Online | None, K: int) -> np.ndarray:
    """[R, K] draws with replacement, `draw(count)` [R, count] extending one stream: the first K online ones of
    each row (drawing up to MAX_DRAWS_PER_CLIENT K), then offline ones."""
    if online is None:
        return draw(K)
    count = 2 * K
    while True:
        drawn = draw(count)
        if (online.mask(drawn).sum(axis=1) >= K).all() or count >= MAX_DRAWS_PER_CLIENT * K:
            return _online_first(drawn, online, K)
        count *= 2


@part("sampler", "full")
class FullParticipation(Sampler):
    """Every client, weighted by p_k."""

    def __init__(self, num_clients: int, clients_per_round: int | None = None):
        self.num_clients = num_clients

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray) -> Selection:
        R, N = len(replicas), self.num_clients
        clients = np.broadcast_to(np.arange(N), (R, N)).copy()
        # p covers every client; the training ones come first (dataset.unseen_clients: the unseen, weight 0, last)
        return Selection(clients, np.broadcast_to(p[:N], (R, N)).copy(), np.ones((R, N)))


class _PartialSampler(Sampler):
    """K = clients_per_round clients of num_clients (harness/config/schema.py checks K <= N without replacement)."""

    def __init__(self, num_clients: int, clients_per_round: int):
        self.num_clients, self.K = num_clients, clients_per_round

    def _without_replacement(self, seed: int, replicas: np.ndarray, rnd: int, online: Online | None) -> np.ndarray:
        if self.num_clients > SHUFFLE_MAX_CLIENTS:
            return np.stack([_distinct_uniform(seed, r, rnd, self.K, self.num_clients,
                                               None if online is None else online.rows([i]))
                             for i, r in enumerate(replicas)])
        u = _uniforms(seed, replicas, rnd, self.num_clients)
        return _online_first(np.argsort(u, axis=1, kind="stable"), online, self.K)

    def _with_replacement(self, seed: int, replicas: np.ndarray, rnd: int, probs, online: Online | None) -> np.ndarray:
        return _online_draws(lambda count: draw_by_weight(probs, _uniforms(seed, replicas, rnd, count)), online, self.K)

    def _uniform_with_replacement(self, seed: int, replicas: np.ndarray, rnd: int, online: Online | None) -> np.ndarray:
        def draw(count: int) -> np.ndarray:
            u = _uniforms(seed, replicas, rnd, count)
            return np.minimum(np.floor(u * self.num_clients).astype(np.int64), self.num_clients - 1)
        return _online_draws(draw, online, self.K)

    def _equal(self, clients: np.ndarray) -> np.ndarray:
        return np.full(clients.shape, 1.0 / self.K)


@part("sampler", "scheme_i")
class SchemeI(_PartialSampler):
    """Li et al. scheme I: K draws with replacement by p_k, q_k = 1/K, duplicates counted."""

    with_replacement = True

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        clients = self._with_replacement(seed, replicas, rnd, p, online)
        return Selection(clients, self._equal(clients), np.ones(clients.shape))


@part("sampler", "scheme_ii")
class SchemeII(_PartialSampler):
    """Li et al. scheme II: K uniform without replacement, q_k = p_k N / K, NOT renormalised."""

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        clients = self._without_replacement(seed, replicas, rnd, online)
        return Selection(clients, p[clients] * self.num_clients / self.K, np.ones(clients.shape))


@part("sampler", "scheme_ii_transformed")
class TransformedSchemeII(_PartialSampler):
    """Li et al.'s transformed scheme II: K uniform without replacement, q_k = 1/K, client lr times N p_k.

    Client k minimises the rescaled objective N p_k F_k, so the plain mean is unbiased; on
    balanced data (p_k = 1/N) it is scheme II exactly.
    """

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        clients = self._without_replacement(seed, replicas, rnd, online)
        return Selection(clients, self._equal(clients), p[clients] * self.num_clients)


@part("sampler", "original")
class OriginalScheme(_PartialSampler):
    """McMahan et al.'s original scheme: K uniform without replacement; absent clients keep the old model.

    w = sum_{k not in S} p_k w_old + sum_{k in S} p_k w_k, i.e. Delta = sum_{k in S} p_k Delta_k.
    Its expectation is (K/N) sum_k p_k Delta_k: biased towards the old model unless K = N.
    """

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        clients = self._without_replacement(seed, replicas, rnd, online)
        return Selection(clients, p[clients].astype(np.float64), np.ones(clients.shape))


@part("sampler", "yang_s1")
class YangStrategy1(_PartialSampler):
    """Yang et al. strategy 1: K uniform draws with replacement, weights 1/K, duplicates counted."""

    with_replacement = True

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        clients = self._uniform_with_replacement(seed, replicas, rnd, online)
        return Selection(clients, self._equal(clients), np.ones(clients.shape))


@part("sampler", "yang_s2")
class YangStrategy2(_PartialSampler):
    """Yang et al. strategy 2: K uniform without replacement, weights 1/K."""

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        clients = self._without_replacement(seed, replicas, rnd, online)
        return Selection(clients, self._equal(clients), np.ones(clients.shape))


@part("sampler", "poisson")
class PoissonSampling(_PartialSampler):
    """Each client independently with probability q = K/N (K = clients_per_round: the expected count), weight
    q_k = 1/K: the fixed-denominator estimator (McMahan et al. 2018), unbiased for the clients' plain mean update.
    The sampling that DP-FedAvg's privacy amplification assumes (algorithms/privacy.py). The sample's size varies:
    each replica's row lists its clients in id order, padded to the round's largest sample with weight-0 entries
    (not trained) that repeat its first client; a replica that drew nobody moves nothing (`active`)."""

    def inclusion_rate(self) -> float:
        """q = K/N (contracts.IndependentInclusion: the sampling DP's accountant charges)."""
        return self.K / self.num_clients

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        taken = _uniforms(seed, replicas, rnd, self.num_clients) < self.inclusion_rate()
        if online is not None:  # only online clients can be taken (an inclusion rate of at most q: DP still holds)
            taken &= online.mask(np.broadcast_to(np.arange(self.num_clients), taken.shape))
        counts = taken.sum(axis=1)
        width = max(1, int(counts.max()))
        clients = np.zeros((len(replicas), width), dtype=np.int64)
        weights = np.zeros((len(replicas), width))
        for r, row in enumerate(taken):
            chosen = np.flatnonzero(row)
            clients[r] = chosen[0] if len(chosen) else 0  # padding repeats a sampled client: its tau, weight 0
            clients[r, :len(chosen)] = chosen
            weights[r, :len(chosen)] = 1.0 / self.K
        return Selection(clients, weights, np.ones(clients.shape), counts > 0)


class Dropout(Sampler):
    """Each sampled client fails to return with probability `rate`, independently per (replica, round, client).

    Rule (keeps every weight positive, so aggregators never divide by zero):
    * some survive: the survivors' weights are rescaled so they sum to what the whole
      selection's weights summed to; each dropped slot is re-pointed at a survivor of the
      same replica and shares that survivor's weight, so the executor (which sums
      duplicate draws) trains only survivors and applies exactly their rescaled weights;
    * nobody survives: the round is a no-op for that replica (`Selection.active` is False):
      the engine gives its clients coefficient 0, nobody trains, the server sees Delta = 0
      and the round's tau_eff / chi2 are recorded as null.
    A client drawn twice by a with-replacement scheme drops both draws (it is one device).
    """

    def __init__(self, sampler: Sampler, rate: float):
        self.sampler, self.rate = sampler, float(rate)

    @property
    def with_replacement(self) -> bool:
        return self.sampler.with_replacement

    def returned(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray) -> np.ndarray:
        """[R, K] bool: which sampled clients send their update back."""
        key = streams.stream_key(seed, streams.DROPOUT, np.asarray(replicas)[:, None], rnd, clients)
        return streams.uniform(key, 1)[..., 0] >= self.rate

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray,
               online: Online | None = None) -> Selection:
        sel = self.sampler.select(seed, replicas, rnd, p, **({} if online is None else {"online": online}))
        if self.rate == 0.0:
            return sel
        return apply_dropout(sel, self.returned(seed, replicas, rnd, sel.clients))


def apply_dropout(sel: Selection, returned: np.ndarray) -> Selection:
    """The selection with only the returning clients (see Dropout for the rule)."""
    clients, weights, lr_scale = sel.clients.copy(), sel.weights.copy(), sel.lr_scale.copy()
    active = returned.any(axis=1)
    for r in range(len(clients)):
        alive = np.flatnonzero(returned[r])
        if len(alive) in (0, len(clients[r])):
            continue
        total = weights[r].sum()
        rescaled = weights[r, alive] * (total / weights[r, alive].sum())
        dead = np.flatnonzero(~returned[r])
        target = alive[np.arange(len(dead)) % len(alive)]  # slot each dropped slot now points at
        share = 1 + np.bincount(np.searchsorted(alive, target), minlength=len(alive))
        weights[r, alive] = rescaled / share
        weights[r, dead] = weights[r, target]
        clients[r, dead] = clients[r, target]
        lr_scale[r, dead] = lr_scale[r, target]
    return Selection(clients, weights, lr_scale, active)


def with_dropout(inner: Sampler, dropout: float = 0.0) -> Sampler:
    """The sampler itself, or wrapped in Dropout when `algorithm.dropout` > 0."""
    return Dropout(inner, dropout) if dropout > 0 else inner
