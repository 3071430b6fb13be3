"""What the engine expects of a problem, a model and each part of an algorithm, and what a part's state is.

The engine (harness/core) calls every member below directly, never asking whether a part has it. A member a
part may leave out has its default here: a part gets the defaults by subclassing its Protocol
(`class MySolver(LocalSolver)`); a class that does not must have every member itself, and the registry refuses
it, naming what is missing, when it builds the part.

A part registers itself beside its class (`fedharness.registry.groups.part`); the registries and the signature
binding that builds parts from their keys are fedharness.registry's. This module holds the contracts only.

A capability a problem may have is its own Protocol (ExactSolve, ClosedForm), checked with isinstance by the
code that needs it (harness/references/), never probed member by member.

The state a stateful part keeps between rounds is a mapping of named tensors (a TypedDict below), so a
checkpoint saves it by name, as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, TypedDict, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # annotations only: torch loads with the first module that computes (the results tables and
    # sinks need none of it). The contracts are the ground floor: nothing of the project above base/ is named here.
    import torch

# --- what the parts hand each other ------------------------------------------------------------------------


@dataclass
class ClientKeys:
    """Who trains: client ids, the replica each copy belongs to, and the round."""

    clients: np.ndarray  # [M] int64 client ids
    replicas: np.ndarray  # [M] int64 stream replica ids
    round: int
    seed: int | np.ndarray  # the run's seed, or each copy's [M] (a batch of slots)
    tau: np.ndarray | None = None  # [M] each copy's own local steps this round (None: all train `steps`)


@dataclass
class Evaluation:
    """Per-replica metrics of the global model; None where a metric does not apply."""

    train_loss: np.ndarray
    grad_norm_sq: np.ndarray | None  # None: not computed (eval.grad_norm=false)
    test_loss: np.ndarray | None = None
    test_acc: np.ndarray | None = None
    extra: dict[str, np.ndarray] = field(default_factory=dict)
    # A population too large to sum over (problems/estimate.py): train_loss is an estimate on a sample of clients
    # and train_loss_se its standard error (None: train_loss is exact). exact_train_loss: F where it is known
    # in closed form all the same (the lazy quadratic population), so subopt stays exact.
    train_loss_se: np.ndarray | None = None
    exact_train_loss: np.ndarray | None = None


CLIENT_STATS = ("mean", "se", "p10", "p50", "p90")
PROTOCOLS = ("global", "finetune", "personal")  # eval.personal: what model each client is scored with


def client_columns(protocol: str = "global", unseen: bool = False) -> tuple[str, ...]:
    """A protocol's rounds/ columns: client_{acc,loss}_{stat} (global), client_{acc,loss}_{protocol}_{stat} (the
    others); the unseen clients' (dataset.unseen_clients) the same, prefixed unseen_."""
    infix = "" if protocol == "global" else f"{protocol}_"
    lead = "unseen_client" if unseen else "client"
    return tuple(f"{lead}_{m}_{infix}{s}" for m in ("acc", "loss") for s in CLIENT_STATS)


CLIENT_COLUMNS = tuple(c for unseen in (False, True) for p in PROTOCOLS for c in client_columns(p, unseen))


@dataclass
class ClientScores:
    """Per-client evaluation (eval.per_client): every evaluated client's loss and accuracy on its own held-out data.

    `clients` [S] are the client ids evaluated (all N, or a fixed uniform sample of S drawn without replacement),
    `n` [S] their held-out samples, `loss` and `acc` [R, S] float64 their mean loss and accuracy per replica (NaN
    where n = 0). `population` is N. `protocol`: the models scored (eval.personal: global, finetune)."""

    clients: np.ndarray
    n: np.ndarray
    loss: np.ndarray
    acc: np.ndarray
    population: int
    protocol: str = "global"

    def rows(self, index: np.ndarray) -> "ClientScores":
        """The scores of replica rows `index` only."""
        return ClientScores(self.clients, self.n, self.loss[index], self.acc[index], self.population, self.protocol)

    def part(self, training: int, unseen: bool) -> "ClientScores":
        """The scores of the training clients (ids below `training`) or of the unseen ones (dataset.unseen_clients:
        the ids from `training` on), each part its own population."""
        at = (self.clients >= training) if unseen else (self.clients < training)
        population = self.population - training if unseen else training
        return ClientScores(self.clients[at], self.n[at], self.loss[:, at], self.acc[:, at], population,
                            self.protocol)

    def columns(self, i: int, protocol: str = "global", unseen: bool = False) -> dict[str, float | None]:
        """Replica row i's rounds/ columns (client_columns(protocol, unseen)): the {mean,se,p10,p50,p90} of acc and
        loss over the clients with held-out data, each client counted once; percentiles by numpy's linear
        interpolation (type 7). se: the mean's standard error over a sample of clients (sample std / sqrt(S),
        times the finite-population factor sqrt(1 - S/N)); null when every client is evaluated (the mean is
        exact). A metric the problem does not have (the analytic problems' accuracy: NaN) is null."""
        has = self.n > 0
        names = dict(zip(((m, s) for m in ("acc", "loss") for s in CLIENT_STATS), client_columns(protocol, unseen)))
        out: dict[str, float | None] = {}
        for name, values in (("acc", self.acc[i, has]), ("loss", self.loss[i, has])):
            if len(values) == 0 or np.isnan(values).all():
                out.update({names[name, s]: None for s in CLIENT_STATS})
                continue
            p10, p50, p90 = np.percentile(values, (10, 50, 90))
            sampled = len(self.clients) < self.population and len(values) > 1
            se = (values.std(ddof=1) / np.sqrt(len(values)) * np.sqrt(1 - len(self.clients) / self.population)
                  if sampled else None)
            out.update({names[name, "mean"]: float(values.mean()), names[name, "se"]: se,
                        names[name, "p10"]: float(p10), names[name, "p50"]: float(p50),
                        names[name, "p90"]: float(p90)})
        return out


def training_clients(problem: Any) -> int:
    """The clients a run trains, ids 0.. of this count: all, less dataset.unseen_clients' (numbered last)."""
    return int(getattr(problem, "training_clients", None) or problem.num_clients)


@dataclass
class Selection:
    """A sampler's choice for a round: a multiset of clients per replica and their weights."""

    clients: np.ndarray  # [R, K] int64
    weights: np.ndarray  # [R, K] float64: Delta = sum_k weights * Delta_k
    lr_scale: np.ndarray  # [R, K] float64: client learning-rate multiplier
    active: np.ndarray | None = None  # [R] bool; False: no sampled client returned, the round moves nothing


@dataclass
class ReplicaLayout:
    """What each replica on the leading axis is: its random stream and its step-size / local-step factors.

    Plain seeds: stream r, factors 1. Richardson-Romberg couples replicas that share a
    stream (or not) and differ by a factor 2 in the step size or the local steps.
    """

    stream_ids: np.ndarray
    lr_factor: np.ndarray
    tau_factor: np.ndarray
    init_ids: np.ndarray | None = None  # which initial point each replica starts from (default: its own)

    def __post_init__(self):
        if self.init_ids is None:
            self.init_ids = np.arange(len(self.stream_ids))

    @classmethod
    def seeds(cls, replicas: int) -> "ReplicaLayout":
        return cls(np.arange(replicas), np.ones(replicas), np.ones(replicas, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.stream_ids)


@dataclass
class WeightStats:
    """Per sampled client: ||a||_1, ||a||_2^2 and the last entry a_{tau-1}, in units of its own first step size.

    `scale` is the client's lr multiplier s_k (None: all 1): its delta is s_k times larger, so its
    share of the aggregate is q_k s_k ||a_k||_1 (transformed scheme II scales by N p_k).
    """

    l1: np.ndarray
    l2sq: np.ndarray
    last: np.ndarray
    scale: np.ndarray | None = None


@dataclass
class Coefficients:
    """An aggregator's coefficient c_k of each client's delta, and FedNova's diagnostics (NaN: not computed)."""

    coef: np.ndarray  # [R, K]
    tau_eff: np.ndarray  # [R]
    chi2: np.ndarray  # [R]: chi^2(p || w) of the sampled weights against the effective ones
    slowdown: np.ndarray  # [R]: mean tau / tau_eff

    def idle(self, idle: np.ndarray) -> None:
        """Replicas `idle` [R] bool train nobody this round (dropout): coefficient 0, diagnostics NaN."""
        self.coef = np.where(idle[:, None], 0.0, self.coef)
        self.tau_eff = np.where(idle, np.nan, self.tau_eff)
        self.chi2 = np.where(idle, np.nan, self.chi2)
        self.slowdown = np.where(idle, np.nan, self.slowdown)


# --- what a part keeps between rounds (checkpointed by name, as plain data) ---------------------------------


class ControlVariate(TypedDict):
    """SCAFFOLD's control variate: the server's c (server context) or a client's c_i (client state)."""

    control: torch.Tensor  # float64 [R, dim] (server) or [dim] (one client of one replica)


class MomentumState(TypedDict):
    """Server momentum / Nesterov."""

    buf: torch.Tensor  # float64 [R, dim]


class AdamState(TypedDict):
    """FedAdam / FedYogi: first and second moments."""

    m: torch.Tensor  # float64 [R, dim]
    v: torch.Tensor  # float64 [R, dim]


class FedExPState(TypedDict):
    """FedExP: the server step size eta_g of each replica's last step (NaN before the first)."""

    eta: torch.Tensor  # float64 [R, 1]


class LastTwoState(TypedDict):
    """The last two iterates (series last_two: FedExP's reported iterate is their average)."""

    last: torch.Tensor  # [R, dim]
    prev: torch.Tensor  # [R, dim]


class MimeContext(TypedDict):
    """Mime / MimeLite's server context: the server momentum m and the last round's sum_k c_k grad F_k(x)."""

    momentum: torch.Tensor  # float64 [R, dim]
    grad: torch.Tensor  # float64 [R, dim]


class AverageState(TypedDict):
    """A Polyak-Ruppert average (series hooks)."""

    sum: torch.Tensor  # float64 [R, dim]
    count: int
    last: torch.Tensor  # the last iterate [R, dim]


class FedDynState(TypedDict):
    """FedDyn's server: h = (1/N) sum_k g_k, the mean of every client's g_k (Acar et al.)."""

    h: torch.Tensor  # float64 [R, dim]


class SolverState(TypedDict, total=False):
    """A local solver's state within one round: every tensor holds the M client copies on its first axis."""

    w0: torch.Tensor  # the round's starting point of each copy
    buf: torch.Tensor | None  # client momentum, reset each round
    c: torch.Tensor  # SCAFFOLD: the server's control variate, per copy
    c_i: torch.Tensor  # SCAFFOLD: the client's own
    correction: torch.Tensor  # SCAFFOLD: c - c_i in the model's dtype
    # the step's minibatch gradient at other points of the copies, v [n, dim] -> [n, dim] (Mime's at w0, pFedMe's inner
    # steps, Per-FedAvg's adapted point and Hessian-free product, APFL's mixture, Ditto's personal model)
    grad_at: Callable[["torch.Tensor"], "torch.Tensor"]
    v: torch.Tensor  # Ditto, APFL: each copy's personal model v_k [M, dim]
    theta: torch.Tensor  # pFedMe: each copy's latest personal model theta [M, dim]
    alpha: torch.Tensor  # APFL: each copy's alpha_k [M, 1]; v and alpha are views of its kept slot value `kept`
    kept: torch.Tensor
    held: torch.Tensor  # Mime, MimeLite: beta m, the server's momentum term held fixed during the round
    mu: torch.Tensor  # a batch of slots: each copy's own proximal mu [M, 1] (else the solver's own)
    momentum: torch.Tensor  # a batch of slots: each copy's own client momentum [M, 1]
    p: torch.Tensor  # each copy's client weight p_k [M] float64, set by the shard after init_state
    g_k: torch.Tensor  # FedDyn: the client's g_k [M, dim] float64
    linear: torch.Tensor  # FedDyn: g_k in the model's dtype


ServerState = Mapping[str, "torch.Tensor"]  # a server optimizer's: {} (sgd), MomentumState, AdamState, FedExPState
ServerContext = Mapping[str, "torch.Tensor"]  # what a solver keeps on the server and sends the shards: {}, ControlVariate
ClientState = Mapping[str, "torch.Tensor"]  # a (replica, client)'s slots by name, as its shard's ClientStore keeps them


@dataclass(frozen=True)
class ClientSlot:
    """One value a part keeps per (replica, client) across rounds (SCAFFOLD's c_i, FedBN's buffers, error feedback's
    residual, a personal model), in the ClientStore of the shard that owns the client (harness/core/client_store.py):
    checkpointed by its shard, restored on resume, following the client at any shard count. `init(w0, server_ctx)`
    gives the value at a client's first participation from the copies' round start w0 [m, dim] and the server
    context's rows [m, ...]; None: the part is handed None there (and decides itself)."""

    name: str
    shape: tuple[int, ...]
    dtype: "torch.dtype"
    init: Callable[["torch.Tensor", Mapping[str, "torch.Tensor"]], "torch.Tensor"] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of one (replica, client)'s value."""
        import math

        import torch  # here, not at the top: the contracts load no torch

        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


@runtime_checkable
class KeepsClientState(Protocol):
    """A part (solver, update stage, model) that keeps something per client across rounds: it declares its slots,
    which the run checks against memory_budget_gb before it starts and each shard's ClientStore keeps."""

    def client_slots(self, problem: "Problem") -> tuple[ClientSlot, ...]:
        """The slots this part reads and writes for `problem` (names unique within the run)."""


# --- the model and the problem ------------------------------------------------------------------------------


@runtime_checkable
class Model(Protocol):
    """A model and its loss over flat parameter vectors, batched over client copies (problems/objectives.py)."""

    name: str
    convex: bool
    dim: int
    l2: float  # weight of the ridge term l2 ||w||^2
    kernel: str | None = None  # how a net batches its copies' gradients (core/kernels.py); None: nothing to choose
    # A net's float buffers (BatchNorm statistics) are the last `buffer_dim` entries of its flat vector; its
    # `batch_grad` returns their values after the step's forward pass there (core/buffers.py writes them in).
    buffer_dim: int = 0
    buffers: str = "average"  # average | local: shared through the server, or kept per client (FedBN)
    # The head (FedRep's and FedBABU's per-client or frozen part): entries [lo, hi) of the flat vector, the
    # parameters of the module the model names as its head (a linear model: all of it, its only layer); None: none.
    head: tuple[int, int] | None = None
    stochastic: bool = False  # draws random numbers in training (dropout): batch_grad takes per-copy `seeds`

    def prepare(self, x: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def prepare_chunk(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def init(self, replicas: int, seed: int, dtype: torch.dtype) -> torch.Tensor: ...

    def batch_grad(self, w: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Minibatch gradients of M client copies w [M, dim] at once."""

    def loss_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed data loss and number of correct predictions, per replica: ([R], [R])."""

    def regularizer(self, w: torch.Tensor) -> torch.Tensor: ...

    def activation_bytes(self, batch: int, itemsize: int) -> int: ...


@runtime_checkable
class Problem(Protocol):
    """Client weights, batched local gradients, evaluation.

    A problem's parameters are a flat vector of `dim` entries. The engine trains M client copies at once as a
    [M, dim] tensor; the problem draws every minibatch of a round from the counter-based streams, so the
    result never depends on how the clients are grouped into shards.
    """

    num_clients: int
    dim: int
    weights: np.ndarray  # p_k, float64, sums to 1
    sizes: np.ndarray  # n_k, number of training samples (1 for sample-free objectives)
    convex: bool
    dtype: torch.dtype
    device: torch.device
    memory_budget: int | None = None  # bytes one batched step may use (memory_budget_gb); None: no bound
    objective: Model | None = None  # the model and loss of a data problem; None: an analytic objective
    client_names: list[str] | None = None  # each client's owner (natural clients of named owners); None: indices

    def init_params(self, replicas: int, seed: int) -> torch.Tensor: ...

    def round_batches(self, keys: ClientKeys, steps: int) -> Any:
        """All the randomness local training of a round needs, drawn at once."""

    def grad(self, w: torch.Tensor, batches: Any, step: int) -> torch.Tensor:
        """Stochastic gradient of each client's objective at local step `step`: [M, dim]."""

    def loop_grad(self, w: torch.Tensor, batches: Any, step: int) -> torch.Tensor:
        """The same gradient computed the slow, obvious way (the loop executor checks the fast path)."""

    def entry_bytes(self, steps: int) -> int:
        """Bytes one client copy of a batched local step needs besides its parameter vectors."""

    def evaluate(self, w: torch.Tensor, grad_norm: bool = True) -> Evaluation:
        """Metrics of each replica's global model w [R, dim]. grad_norm=False (eval.grad_norm): grad_norm_sq is None
        and the full gradient is not computed; every other value is the same as with it. A Problem whose evaluate takes
        no grad_norm is called with w alone (harness/runs/execute.py skips_grad_norm)."""

    def objective_value(self, w: torch.Tensor) -> torch.Tensor:
        """F(w) per replica, float64."""

    def data_split(self, split: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The samples and labels of `split` (train | test) as the model takes them; None: the problem has none."""
        return None


@runtime_checkable
class SampleTerms(Protocol):
    """A model that gives each sample's loss and correctness (the built-in models): per-client evaluation then sums
    them by client in one pass over the held-out data, vectorized over clients and replicas."""

    def sample_terms(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's data loss and whether it is predicted right, per replica: ([R, n], [R, n]), in eval mode."""


@runtime_checkable
class ClosedFormTerms(Protocol):
    """A model whose summed loss has a gradient in closed form (the linear models): evaluation then computes the
    loss and its gradient without autograd, and the test set's loss and correct predictions without a graph, a
    chunk of samples at a time. Each replica's numbers come from its own product (bmm over replicas), so they do
    not depend on how many replicas are evaluated beside it."""

    def loss_and_grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed data loss [R] (float64) over samples x [n, ...], y [n] and its gradient [R, dim] (w's dtype)."""

    def summed_loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """loss_and_grad's summed data loss [R] (float64), the same bits, without the gradient."""

    def loss_and_correct(self, w: torch.Tensor, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed data loss [R] (float64) and number of correct predictions [R], without a graph (loss_terms's
        values up to rounding)."""


@runtime_checkable
class BufferTerms(Protocol):
    """A model scored with several sets of its buffers at once, its parameters shared, each set on its own samples
    (the built-in nets): FedBN's clients, each with its own buffers, are then scored together."""

    def buffer_sample_terms(self, w: torch.Tensor, buffers: torch.Tensor, x: torch.Tensor,
                            y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model w [dim] with buffers[m] ([M, buffer_dim]) on samples x[m], y[m] ([M, n, ...], [M, n]): each
        sample's loss and whether it is predicted right, ([M, n], [M, n]), in eval mode."""


@runtime_checkable
class ClientEvaluation(Protocol):
    """A problem that evaluates each client on its own held-out data (eval.per_client; problems/client_eval.py)."""

    def client_scores(self, w: torch.Tensor, clients: np.ndarray,
                      buffers: Mapping[tuple[int, int], torch.Tensor] | None = None) -> ClientScores:
        """Scores of `clients` [S] for each replica's model w [R, dim]. `buffers`: (row of w, client) -> that
        client's own buffers (model.buffers=local, FedBN), used in place of w's for that client."""


@runtime_checkable
class ClientGradients(Protocol):
    """A problem that gives each client's full-batch gradient (Mime and MimeLite send it: LocalSolver.round_gradient)."""

    def full_grads(self, w: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
        """grad F_k(w_m) of client clients[m] at w [M, dim] (float64 [M, dim]): its whole local objective."""


@runtime_checkable
class CopyEvaluation(Protocol):
    """A problem that scores several models, each on its own client's held-out data (eval.personal's finetune:
    every client's fine-tuned model; problems/client_eval.py)."""

    def copy_scores(self, w: torch.Tensor, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Model w[m] ([M, dim], its buffers in its last entries) on client clients[m]'s held-out data: each
        copy's held-out samples n [M], mean loss [M] and accuracy [M] (float64; NaN where n = 0, and the
        accuracy of a problem without one)."""


@runtime_checkable
class ExactSolve(Protocol):
    """A problem whose global objective F is built whole, so harness/references/ can solve for the exact w*, F*
    (and each client's F_k*). A problem without it (lazily generated clients) has no exact reference."""

    def objective_and_grad(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact global objective F and its gradient at w [R, dim] (used by the reference solver)."""

    def with_dtype(self, dtype: torch.dtype) -> ExactSolve:
        """The same problem in another dtype (the reference solver runs in float64)."""

    def hessians(self) -> np.ndarray | None:
        """The clients' constant Hessians A_k [N, dim, dim] of a quadratic objective; None: not quadratic."""
        return None

    def client_minima(self) -> np.ndarray | None:
        """Every client's F_k* in closed form; None: none known (harness/references/closed_forms.py may solve for it)."""
        return None


@runtime_checkable
class ClosedForm(ExactSolve, Protocol):
    """An exactly solvable problem whose optimum is known in closed form (the quadratics): no Newton solve."""

    def optimum(self) -> np.ndarray:
        """w* [dim], float64."""

    def hessian_sum(self) -> np.ndarray:
        """sum_k p_k A_k [dim, dim]: F is strongly convex iff it is positive definite."""


@runtime_checkable
class Reference(Protocol):
    """The exact optimum of a problem's F (harness/references/solve.py solves for it, in float64)."""

    w_star: np.ndarray  # float64 [dim]
    f_star: float
    grad_norm: float  # ||grad F(w*)||: how exact the solve is


# --- the parts --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Links:
    """A systems profile's per (row, client) [R, K] values (algorithms/systems.py): seconds per local step,
    downlink and uplink in MB/s (10^6 bytes a second)."""

    step_s: np.ndarray
    down_MB_per_s: np.ndarray
    up_MB_per_s: np.ndarray
    same_links: bool = True  # up == down everywhere: a transfer is (down + up bytes) / bandwidth, as one link


class Speeds(Protocol):
    """Each client's step time and links (the `speed` group): a pure function of (seed, replica, client)."""

    def links(self, seeds: np.ndarray, replicas: np.ndarray, clients: np.ndarray) -> Links:
        """Seeds and replicas [R], clients [R, K]."""
        ...


class Availability(Protocol):
    """When each client is online (the `availability` group): a pure function of (seed, replica, client, time)."""

    always: bool = False  # every client online at every time: the clock asks nobody (algorithms/systems.py)

    def online(self, seeds: np.ndarray, replicas: np.ndarray, t: np.ndarray, clients: np.ndarray) -> np.ndarray:
        """[R, K] bool: whether each row's clients are online at that row's time t [R] (seconds)."""
        ...


@dataclass(frozen=True)
class Online:
    """Who is online at each row's round start t [R] (harness/core/clock.py): what a sampler that prefers online
    clients asks, by `mask`."""

    availability: Availability
    seeds: np.ndarray
    replicas: np.ndarray
    t: np.ndarray

    def mask(self, clients: np.ndarray) -> np.ndarray:
        """[R, M] bool for clients [R, M]."""
        return self.availability.online(self.seeds, self.replicas, self.t, clients)

    def rows(self, index) -> "Online":
        return Online(self.availability, self.seeds[index], self.replicas[index], self.t[index])


@runtime_checkable
class Sampler(Protocol):
    """Who takes part in a round and with which aggregation weight q_k (algorithms/samplers.py). A sampler whose
    `select` also takes `online` (an Online, on a run with the systems clock) can prefer the online clients; any
    other's offline picks drop out."""

    with_replacement: bool = False  # a client may be drawn twice in a round (each draw counts)

    def select(self, seed: int, replicas: np.ndarray, rnd: int, p: np.ndarray) -> Selection: ...


@runtime_checkable
class LocalWork(Protocol):
    """How many local steps tau_k each sampled client makes (algorithms/local_work.py)."""

    def steps(self, seed: int, replicas: np.ndarray, rnd: int, clients: np.ndarray, sizes: np.ndarray,
              batch_size: int) -> np.ndarray:
        """[R, K] int64 local steps of the sampled `clients` [R, K]."""


@runtime_checkable
class Schedule(Protocol):
    """The client step size of each local step of a round, a pure function of (round, step) (algorithms/schedules.py)."""

    def step_lrs(self, rnd: int, steps: int) -> np.ndarray:
        """The sizes of local steps 0..steps-1 of round `rnd`."""


@runtime_checkable
class LocalSolver(Protocol):
    """The update each client applies at every local step, vectorized over client copies (algorithms/solvers.py)."""

    # model entries a client never sends or receives (FedRep's and FedBABU's head): not counted in the bytes
    private_dim: int = 0
    # eval.personal=personal: the personal steps a client without a kept personal model takes (PersonalSolver);
    # None: eval.finetune_steps (Per-FedAvg: 1, its one adaptation step)
    personal_steps: int | None = None

    comm_factor: int = 1  # model-sized vectors each way per client and round (SCAFFOLD: 2, its control variate)
    extra_down: int = 0  # model-sized vectors sent down besides comm_factor's (Mime: the control variate c)
    # The round's clients' full-batch gradients at the server model, sum_k c_k grad F_k(x) (a ClientGradients
    # problem), reach update_server_ctx as extras["grad"]: "before" in a pass of their own ahead of the local steps,
    # also sent in the server context as "grad" (Mime's control variate c); "after" with the training (MimeLite).
    round_gradient: str = "none"
    grads_per_step: int = 1  # minibatch gradients a local step takes (state grad_at's besides g): grad_evals counts them
    # step_lrs and weight_stats also take step sizes [R, T], each row (replica) its own: a batch of slots then asks
    # once for all the alike slots' rows (harness/core/slots.py SlotSolver), not slot by slot
    rows_of_step_sizes: bool = False

    def init_state(self, w0: torch.Tensor, server_ctx: ServerContext | None = None,
                   saved: list[ClientState] | None = None) -> SolverState:
        """Per-round state of M client copies w0 [M, dim]."""

    def update(self, w: torch.Tensor, g: torch.Tensor, lr: torch.Tensor, state: SolverState) -> torch.Tensor:
        """One local step in place for the M copies w [M, dim] (a prefix of the round's batch), lr [M, 1]."""

    def weight_stats(self, tau: np.ndarray, step_lrs: np.ndarray, lr_scale: np.ndarray | None = None) -> WeightStats:
        """||a_k||_1, ||a_k||_2^2 and a_k's last entry of the solver's weighting vector (Wang et al.)."""

    def step_lrs(self, base_lrs: np.ndarray) -> np.ndarray:
        """The schedule's step sizes as the solver takes them within a round."""
        return base_lrs

    def begin(self, w: torch.Tensor, state: SolverState) -> None:
        """The copies w [M, dim] (w0's clones) set in place to where their local steps start (FedRep: each
        client's own head); by default where the server's model is."""

    def finish(self, w0: torch.Tensor, w: torch.Tensor, lr_sum: torch.Tensor, state: SolverState,
               p: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """New persistent client state and per-client sums to reduce (none for a stateless solver)."""
        return {}, {}

    def init_server_ctx(self, x: torch.Tensor) -> ServerContext:
        """What the solver keeps on the server (SCAFFOLD's c); sent to the shards every round."""
        return {}

    def update_server_ctx(self, ctx: ServerContext, extras: dict[str, torch.Tensor]) -> ServerContext:
        """The server context after a round whose shards reduced `extras` (the sums `finish` returned)."""
        return ctx


@runtime_checkable
class PersonalSolver(Protocol):
    """A solver whose clients each have a model of their own, which eval.personal=personal scores (Ditto, FedRep,
    FedBABU; algorithms/personal.py; harness/core/personal.py scores it in the shard that owns the client).

    A client that keeps `personal_slot` (it trained) is scored with personal_model(global, kept); any other (not yet
    sampled, or unseen: dataset.unseen_clients) with the global model after eval.finetune_steps of `personal_step`
    on its own minibatches. `personal_slot` None: every client is personalized so (FedBABU)."""

    personal_slot: str | None

    def personal_model(self, w: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """[m, dim]: the personal models of copies of the global model w [m, dim] whose clients keep `kept`."""

    def personal_step(self, v: torch.Tensor, g: torch.Tensor, lr: float, w: torch.Tensor) -> None:
        """One step of personalization in place of copies v [m, dim] (gradient g) started from the global w."""


@runtime_checkable
class Aggregator(Protocol):
    """The coefficient c_k of each client's delta in Delta = sum_k c_k Delta_k (algorithms/aggregators.py)."""

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients: ...


@runtime_checkable
class UpdateAggregator(Aggregator, Protocol):
    """An aggregator that sees the updates (algorithms/robust.py): the shards send each sampled client's Delta_k
    and `aggregate` makes the server's Delta of one replica from them (median, trimmed mean, Krum, clipping).

    Its `coefficients` weigh each draw (default: the sampler's q_k, FedNova's diagnostics not computed); a client's
    draws' weights add up to the weight `aggregate` gets with its update, and a draw of weight 0 (a dropped-out
    client) is not trained. The linear aggregators' shards keep reducing in place and send no update.
    """

    def coefficients(self, q: np.ndarray, stats: WeightStats, tau: np.ndarray) -> Coefficients:
        nan = np.full(len(q), np.nan)
        return Coefficients(np.array(q, dtype=np.float64), nan, nan.copy(), nan.copy())

    def aggregate(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One replica's Delta [dim] float64 from its updates [n, dim] float64 and their weights [n] float64.

        One row per sampled client that returned (n >= 1), ordered by client id; its weight is the sum of its
        draws' coefficients, as in the linear path (a client drawn twice by scheme I, or a dropped-out draw
        that dropout re-points at it, is one row with the summed weight). Replicas are aggregated one at a
        time, each on its own; a replica nobody returned to gets Delta = 0 without a call.
        """


@runtime_checkable
class ServerOptimizer(Protocol):
    """x_{r+1} from x_r and the aggregated delta (algorithms/server.py)."""

    server_lr: float | None = None  # eta_g, recorded in the rounds table (None: the optimizer has none)
    # The step also takes `sq_norms` [R] float64: sum_k c_k ||Delta_k||^2 over the updates Delta_k the aggregate
    # Delta = sum_k c_k Delta_k was made of (FedExP); the shards send one number per trained client for it.
    reads_sq_norms: bool = False

    def step(self, x: torch.Tensor, delta: torch.Tensor, state: ServerState, lr: np.ndarray | None = None) \
            -> torch.Tensor:
        """The new model; `state` is updated in place; `lr` [R] the round's first client step size."""

    def init_state(self, x: torch.Tensor) -> ServerState:
        return {}

    def step_sizes(self, state: ServerState) -> np.ndarray | None:
        """[R] the eta_g of each replica's last step where it changes from round to round (FedExP: the rounds
        table's server_lr then has each row's own); None: the constant server_lr."""
        return None


@runtime_checkable
class SeriesHook(Protocol):
    """Extra recorded iterates (core/series.py): Polyak-Ruppert averages, Richardson-Romberg extrapolation."""

    def init_state(self, x: torch.Tensor) -> AverageState: ...

    def observe(self, hs: AverageState, x: torch.Tensor, rnd: int, rounds: int) -> None: ...

    def series(self, hs: AverageState) -> dict[str, tuple[torch.Tensor, np.ndarray]]: ...


@dataclass
class Algorithm:
    """The parts an algorithm is composed of (algorithms/registry.py builds it from the `algorithm` config)."""

    name: str
    sampler: Sampler
    local_work: LocalWork
    schedule: Schedule
    solver: LocalSolver
    aggregator: Aggregator
    server: ServerOptimizer
    batch_size: int


@runtime_checkable
class Attack(Protocol):
    """What a round's Byzantine clients send in place of their updates (algorithms/attacks.py). Which clients are
    Byzantine is the harness's draw (algorithms/byzantine.py: `attack.fraction` of the clients that returned, from the
    streams), so it is the same at any shard count and on resume; the forged updates replace theirs before an
    aggregator that sees the updates (contracts.UpdateAggregator) makes the round's Delta."""

    def forge(self, own: torch.Tensor, honest: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        """[b, dim] float64: what the b Byzantine clients of one replica send, from their own honest updates
        `own` [b, dim] float64, the round's honest updates `honest` [h, dim] float64 (h >= 1; the omniscient
        attacks read them, as their papers assume) and one stream key per Byzantine client, [b] uint64
        (base/streams.py), for the attack's own random draws."""


@runtime_checkable
class Compressor(Protocol):
    """What a client sends in place of its update (algorithms/compression.py; `compress=NAME`): an encoding of
    fixed size, decoded here at once, as the server would decode it. Its random draws (random-k's coordinates,
    QSGD's rounding) come from one stream key per client, so the same bits come out at any shard count. Error
    feedback is the stage's (compress.error_feedback), around any compressor."""

    def compress(self, v: torch.Tensor, keys: np.ndarray) -> torch.Tensor:
        """[m, dim] float64: each row of `v` [m, dim] float64 as the server decodes what the client sends; `keys`
        [m] uint64, each row's stream key (base/streams.py: uniform(keys, n) draws [m, n])."""

    def encoded_bytes(self, dim: int, value_bytes: int) -> int:
        """The bytes one client's update of `dim` coordinates takes as sent (`value_bytes`: a float's, 4 in
        float32): what bytes_up counts."""


@runtime_checkable
class DataPoisoning(Protocol):
    """An attack whose Byzantine clients train on a view of the data instead of forging their updates
    (algorithms/attacks.py label_flip): the shards train them on `view_of(problem)`, and the run needs what the
    view needs (`needs`: "labels", a contracts.Labelled problem)."""

    view: str
    needs: frozenset[str]

    def view_of(self, problem: Problem) -> Problem:
        """The problem the Byzantine clients train on."""


@runtime_checkable
class Labelled(Protocol):
    """A problem whose clients train on class labels (problems/data.py DataProblem): label flipping poisons them."""

    def labels_flipped(self) -> "Problem":
        """The same problem with every training label y replaced by C - 1 - y (C classes); a view, no copy of x."""


@runtime_checkable
class IndependentInclusion(Protocol):
    """A sampler that takes each client independently with one probability q (algorithms/samplers.py poisson): the
    sampling whose privacy amplification the DP accountant charges (a stage that `needs` "poisson")."""

    def inclusion_rate(self) -> float:
        """q, each client's probability of taking part in a round."""


# --- a round as its update stages see it ---------------------------------------------------------------------

@dataclass
class RoundPlan:
    """Everything a shard needs to train its part of round `round` (harness/core/executors.py ClientShard)."""

    round: int
    seed: int | np.ndarray  # the run's seed, or each replica's [R] (a batch of slots: harness/core/slots.py)
    stream_replicas: np.ndarray  # [R] stream id of each replica
    clients: np.ndarray  # [R, K]
    coef: np.ndarray  # [R, K] aggregation coefficients c_k
    tau: np.ndarray  # [R, K] local steps
    lr_scale: np.ndarray  # [R, K] client lr multipliers (sampler and per-replica factors)
    step_lrs: np.ndarray  # [max tau] step sizes of this round, or each replica's [R, max tau] (a batch of slots)
    server_ctx: ServerContext = field(default_factory=dict)  # e.g. SCAFFOLD's server control c
    send_updates: bool = False  # an UpdateAggregator: send each client's Delta_k, not the reduced sum
    sq_norms: bool = False  # also send each trained client's c_k ||Delta_k||^2 (ServerOptimizer.reads_sq_norms)
    grads_only: bool = False  # no training: each client's c_k grad F_k(x) into the sum "grad" (round_gradient before)
    stages: tuple[ClientWork, ...] = ()  # the update stages' work in the shards this round, in the stages' order

    def returned(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """Replica r's clients that returned (coefficient != 0), ascending, and each one's weight: the sum of its
        draws' coefficients (a client drawn twice, or a dropped draw re-pointed at it, is one update)."""
        kept = self.coef[r] != 0
        ids, inverse = np.unique(self.clients[r][kept], return_inverse=True)
        return ids, np.bincount(inverse, weights=self.coef[r][kept], minlength=len(ids))

    def replica_seed(self, r: int) -> int:
        """Replica r's seed: the run's, or its slot's in a batch of slots."""
        return int(self.seed) if np.ndim(self.seed) == 0 else int(self.seed[r])


@dataclass
class UpdateChunk:
    """The raw updates Delta_k of one batch of a shard's entries (at most chunk_entries rows), on the CPU."""

    replica: np.ndarray  # [m] int64
    clients: np.ndarray  # [m] int64
    delta: torch.Tensor  # [m, dim] in the model's dtype: w - w0 as computed, so nothing is rounded on the way

    def __getstate__(self) -> dict:  # numpy on the wire, as the sums (core/exact_sum.py NumpyWire): no pickling
        return {**vars(self), "delta": self.delta.detach().cpu().numpy()}

    def __setstate__(self, state: dict) -> None:
        import torch  # here, not at the top: the contracts load no torch

        vars(self).update({**state, "delta": torch.from_numpy(np.array(state["delta"]))})  # out of read-only memory


@runtime_checkable
class ClientWork(Protocol):
    """One update stage's work in the shards for one round, built at the driver (UpdateStage.client_work) and sent
    with the plan to every shard (pickled to a Ray shard: plain arrays and numbers). It may choose clients that
    train on a view of the data (`view`, `chosen`: label flipping) and transform each trained client's update
    before it joins the shard's sum or is sent (`transform`: clipping). Its random draws, if any, come from the
    counter-based streams keyed by (seed, replica, round, client), so the same bits come out at any shard count.
    Subclass it for the defaults: nobody chosen, the update unchanged."""

    view: str | None = None  # the data view's name: the shard builds it once (`view_of`) and keeps it
    kept: str | None = None  # per-client state's name (error feedback's residual): `transform` gets and returns it

    def view_of(self, problem: Problem) -> Problem:
        """The problem the chosen clients train on."""
        return problem

    def chosen(self, replica: np.ndarray, clients: np.ndarray) -> np.ndarray:
        """[m] bool: which of the shard's entries (replica row, client id) train on the view."""
        return np.zeros(len(clients), dtype=bool)

    def transform(self, delta: torch.Tensor, replica: np.ndarray, clients: np.ndarray, *kept: list) -> tuple:
        """Each entry's update delta [m, dim] float64 as it leaves the client; and per-entry integers [m] by name,
        which the shards add up per replica (ShardResult.counts: exact in any order) for the server side. With
        `kept` set, also each entry's state as the shard kept it (a list of m tensors, None for a client's first
        round) and, third, the new states [m, ...]: the shard that owns the client keeps them with its other
        state (SCAFFOLD's c_i), checkpointed and resumed, so they follow the client at any shard count."""
        return delta, {}


SHARDS, ROUND = "shards", "round"  # an UpdateStage's place


@runtime_checkable
class UpdateStage(Protocol):
    """A step of what happens to the clients' updates between their training and the server optimizer
    (docs/architecture.md, "Update stages"): the run's stages, in the order of its `stages` key, each act on the
    client side (`client_work`: in the shards, on each update before it is summed or sent), on the updates at the
    driver (`on_updates`: only with an aggregator that sees them) and on the aggregate (`on_aggregate`: before
    the server optimizer). Per-replica state (adaptive clipping's C) lives in the run's counters, so a checkpoint
    keeps it and the rounds/ table records it; `needs` names the capabilities the run must have, checked before
    it starts: "updates" (an aggregator that sees every update), "poisson" (a sampler of independent inclusion,
    contracts.IndependentInclusion), "labels" (a problem with class labels, contracts.Labelled). Subclass it for
    the defaults: no state, no work, everything passed on unchanged.

    A stage declares its place, and the checks read the declarations (no stage is named in them): `place` SHARDS,
    it acts on each update in its shard alone with no per-replica state (compression), so it means the same
    whichever server step an update joins (a cadence whose updates span versions takes only such stages); ROUND
    (the default), it acts on a round's updates or aggregate, or keeps per-replica state (privacy, attacks).
    `last`: its change to each update in the shards must be the last before the sum, so no SHARDS stage may follow
    it in `stages` (DP-FedAvg's clipping: its guarantee bounds what is summed)."""

    needs: frozenset[str] = frozenset()
    place: str = "round"  # SHARDS | ROUND
    last: bool = False

    def init_counters(self, replicas: int) -> dict[str, np.ndarray]:
        """The stage's per-replica state at round 0, by name (a rounds/ column where the table has one)."""
        return {}

    def client_work(self, plan: RoundPlan, counters: Mapping[str, np.ndarray]) -> ClientWork | None:
        """This round's work in the shards (None: none)."""
        return None

    def on_updates(self, plan: RoundPlan, updates: list[UpdateChunk]) -> list[UpdateChunk]:
        """Every trained client's update, at the driver, before the aggregator (each chunk's delta may be changed
        in place)."""
        return updates

    def on_aggregate(self, plan: RoundPlan, delta: torch.Tensor, counts: Mapping[str, np.ndarray],
                     counters: dict[str, np.ndarray]) -> torch.Tensor:
        """The round's Delta [R, dim] float64 before the server optimizer; `counts`: the client work's integers
        summed per replica; `counters`: the stage's state, updated in place for the next round."""
        return delta

    def row_values(self, rounds: int) -> dict[str, float | None]:
        """Values for the rounds/ rows after `rounds` rounds (DP's epsilon)."""
        return {}

    def upload_bytes(self, dim: int, value_bytes: int) -> int | None:
        """The bytes one client's update takes as sent where this stage encodes it (a compressor's size); None:
        the stage leaves its size as it found it."""
        return None


@dataclass
class RunState:
    """Everything needed to continue a run: server model and state, counters (streams are keyed by round)."""

    round: int
    x: torch.Tensor
    server_state: ServerState  # the server optimizer's (MomentumState, AdamState, ...)
    counters: dict[str, np.ndarray]
    server_ctx: ServerContext = field(default_factory=dict)  # the solver's server side (SCAFFOLD's c)
    series_state: list = field(default_factory=list)  # one AverageState per series hook
    wall_s: float = 0.0
    # a cadence's state between versions (FedBuff's, algorithms/cadences.py): the clients in flight, [R, C] arrays by name and their updates
    # [R, C, dim]; {} for synchronous rounds
    in_flight: dict = field(default_factory=dict)


class Staleness(Protocol):
    """s(tau): the weight of an update tau server versions stale (the `staleness` group: FedAsync's constant,
    polynomial and hinge functions, algorithms/systems.py; a user's: fedharness.register_option("staleness", ...))."""

    def weight(self, tau: np.ndarray) -> np.ndarray:
        """[...] float64 s(tau) of each staleness tau (an integer array)."""
        ...


class Cadence(Protocol):
    """The shape of a server step (the `cadence` group, algorithms/cadences.py, docs/extending.md): which clients
    start when, what a step waits for, what it aggregates with which weights. The engine (core/engine.py) calls
    `step` once a server version and lends it its primitives: plan_round (the sampler, local work, step sizes and
    aggregator coefficients, settled on the systems clock), train_round (train a plan's clients through the stages
    and the aggregator's sum), exact_sum (per-replica sums with a round's bits), count (the counters of a trained
    plan), advance (the server optimizer's step to the next version), and its parts (alg, problem, executor,
    stages, clock, layout). Subclass it: its own step is a synchronous round (cadence=sync)."""

    # whether a client's update may join a later server version than the one it started from: then the run's
    # stages must all act in the shards (Placement.SHARDS), where a stage means the same whichever step it joins
    spans_versions: bool = False
    retry_s: float = 60.0  # how long a step lasts that nobody takes part in (the systems clock's, cadence.retry_s)

    def sampled(self, clients_per_round: int) -> int:
        """How many clients the sampler is built to draw each time it is asked."""
        return clients_per_round

    def init_flight(self, replicas: int, dim: int, device: Any) -> dict:
        """RunState.in_flight at the start: what the cadence carries between versions ({}: nothing)."""
        return {}

    def step(self, engine: Any, state: RunState) -> RunState:
        """One server version, from `state` (version state.round) to the next: a synchronous round, plan, train,
        count, step."""
        plan, coefs = engine.plan_round(state.round, state.counters["sim_s"])
        delta, sq_norms = engine.train_round(state, plan)
        engine.count(state, plan)
        return engine.advance(state, delta, plan.step_lrs[..., 0], coefs, **sq_norms)


@dataclass
class RunOutcome:
    """How a run (one slot of a batch) ended: ok, diverged, stopped, or what the exception that ended it maps to
    (failed, pruned, interrupted); its last completed round, its evaluated rows and its last state."""

    status: str
    rounds_done: int
    rows: list[dict] = field(default_factory=list)
    state: RunState | None = None
    error: BaseException | None = None


# --- a user's metrics and callbacks -------------------------------------------------------------------------

ROUND_COLUMNS = ("run_id", "replica", "series", "round", "local_steps", "grad_evals", "bytes_up", "bytes_down",
                 "wall_s", "sim_s", "participants", "train_loss", "train_loss_se", "subopt", "dist_to_opt", "grad_norm_sq",
                 "test_loss", "test_acc", "lr", "server_lr", "tau_eff", "chi2",
                 "slowdown", "epsilon", "dp_clip_norm", *CLIENT_COLUMNS)  # the rounds/ table's own (sinks/parquet.py)


@dataclass(frozen=True)
class DataSplit:
    """What a metric is computed on: a split's samples and labels as the model takes them (None where the problem
    has no samples, e.g. a quadratic) and the problem's model (None for an analytic objective)."""

    x: torch.Tensor | None
    y: torch.Tensor | None
    model: Model | None


@dataclass(frozen=True)
class Metric:
    """A user's metric: `fn(w, split)` maps the global models w [R, dim] (one row per replica) and a DataSplit to
    R numbers. Registered once (`fedharness.register_metric`); a run computes the ones its `metrics` key names at
    every evaluation, each in its own column of the rounds/ table."""

    name: str
    fn: Callable[[torch.Tensor, DataSplit], Any]
    split: str = "test"  # train | test
    maximize: bool = False  # larger is better (a tuning objective's direction)

    def values(self, problem: Problem, w: torch.Tensor) -> np.ndarray:
        import torch  # here, not at the top: the contracts load no torch (the results tables and sinks need none)

        data = problem.data_split(self.split)
        split = DataSplit(*(data if data is not None else (None, None)), problem.objective)
        with torch.no_grad():
            out = self.fn(w, split)
        out = np.asarray(out.detach().cpu() if isinstance(out, torch.Tensor) else out, dtype=np.float64)
        if out.shape != (w.shape[0],):
            raise ValueError(f"metric {self.name!r} returned shape {out.shape}; it must return one number per "
                             f"replica, shape ({w.shape[0]},)")
        return out


@dataclass(frozen=True)
class RoundContext:
    """Where a run stands, as a callback sees it: after round `round` of `rounds`, the server models x [R, dim],
    the rows evaluated at this round (empty between evaluations), and the run's whole state
    (RunState: what a checkpoint saves)."""

    round: int
    rounds: int
    x: torch.Tensor
    rows: list[dict]
    state: Any = None
    clients: ClientScores | None = None  # eval.per_client: the evaluated clients' scores (on_evaluation only)
    tuned: ClientScores | None = None  # eval.personal's finetune: their fine-tuned scores, where it ran
    own: ClientScores | None = None  # eval.personal's personal: their personal models' scores, where it ran


class Callback(Protocol):
    """Hooks into a run, called in the driver: a user's (`fedharness.run(..., callbacks=[...])`) and the harness's
    own observers (the Parquet and W&B sinks, the progress bar, the checkpointer, the Optuna reporter), in one
    list. A hook that returns True stops the run after this round: it ends with status `stopped`, its rows so far
    recorded. Subclass it and override what you need; the others do nothing."""

    def on_round_end(self, context: RoundContext) -> bool | None:
        """After every round, before its evaluation (not after a round whose models are no longer finite)."""
        return None

    def on_evaluation(self, context: RoundContext) -> bool | None:
        """After every evaluated round, with its rows (one per replica and series)."""
        return None

    def on_end(self, outcome: RunOutcome) -> None:
        """Once, when the run ends: its status, rounds done, rows, last state and the error that ended it (if any)."""
        return None


def callback_name(callback: Any) -> str:
    """How the runs/ row names a callback: its `name` attribute, or its class's qualified name."""
    name = getattr(callback, "name", None)
    return name if isinstance(name, str) else f"{type(callback).__module__}.{type(callback).__qualname__}"
