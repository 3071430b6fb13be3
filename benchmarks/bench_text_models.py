"""The models of the federated text and FEMNIST benchmarks (issues 28, 47), vectorized across clients vs per client
vs torch's own LSTM by plain autograd, on CPU. Sections (`--sections`, default all):

rounds  ms per round at K=10 sampled clients (below).
step    one local step of the harness (NetObjective.batch_grad, each kernel) against the plain reference: torch.nn.LSTM
        with the same weights, plain autograd, client by client (`reference_step`). char_lstm on 3 clients x 24
        windows x 80 characters (LEAF's Shakespeare batch of the 6-user run below); word_lstm on a StackOverflow-
        shaped batch, 3 clients x 16 sentences x 20 tokens (Reddi et al.'s batch), 10,004 words, each sentence
        padded with id 0 after 5-20 words. The variants take turns, `--repeats` times, at 1 and 2 threads; the
        median counts. The peak RSS of each variant is measured in a fresh process of its own (5 steps).
leaf    the 6-user LEAF Shakespeare-shaped folder of issue 47 (40-48 training and 8-16 test windows of 80 characters a
        user, 265 training windows; written under benchmarks/out/leaf6), `fedharness run dataset=leaf
        dataset.path=DIR rounds=3 eval_every=1 algorithm.clients_per_round=3` (model=auto: char_lstm) with a cold
        kernel cache, against `reference_rounds`: the same rounds (3 clients x 20 steps of 24 windows, lr 0.05, and
        4 evaluations: training loss and gradient over the 265 windows, test loss) on torch.nn.LSTM by plain
        autograd. Each in a fresh process, taking turns, at threads=1 and 2: wall seconds and peak RSS.

Each figure is written with the load average (/proc/loadavg) before and after it.

* Shakespeare-shaped: windows of 80 int64 character ids, an 80-letter vocabulary, batch 10 (LEAF's), char_lstm
  (the functional LSTM) with kernel=vmap and kernel=loop, and the same network built on torch.nn.LSTM (its fused
  kernel; registered here as `torch_char_lstm`) with kernel=loop and with kernel=vmap (nn.LSTM has no batching
  rule: vmap falls back to a loop over the copies, with a warning).
* FEMNIST-shaped: 1x28x28 images, 62 classes, batch 10, femnist_cnn with each kernel.

FedAvg, 20 clients, 10 sampled a round, `--steps` local steps, float32, no evaluation between the timed rounds.
The first round (torch's lazy initialisation) is not timed; the variants take turns round by round, so a change
in the machine's load falls on all of them, and the median round counts: wall-clock ms, and the process's CPU ms
(with one thread, what the round costs whatever else the machine runs). Writes benchmarks/out/text_models.json.

    python benchmarks/bench_text_models.py [--sections rounds,step,leaf] [--rounds 3] [--steps 2] [--threads 1]
                                           [--repeats 7] [--runs 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

import fedharness
from fedharness.algorithms.series import build_series
from fedharness.assembly.build import build_parts
from fedharness.config.load import load_settings
from fedharness.core.executors import InlineExecutor
from fedharness.problems.leaf import LETTERS
from fedharness.problems.nets import build_net
from fedharness.problems.objectives import NetObjective
from fedharness.runs.execute import Prepared, build_engine

SEQ, VOCAB, CLASSES, BATCH, K = 80, 80, 62, 10, 10


def shakespeare_shaped(seed: int, n: int = 2000):
    """Random character windows and next characters (a step's time does not depend on the ids)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (n, SEQ), dtype=np.int64), rng.integers(0, VOCAB, n)), None


def femnist_shaped(seed: int, n: int = 2000):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, CLASSES, n)), None


class TorchCharLSTM(nn.Module):
    """char_lstm's architecture on torch.nn.LSTM (two biases a layer: 2,048 parameters more)."""

    def __init__(self, in_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.embedding = nn.Embedding(num_classes, 8)
        self.lstm = nn.LSTM(8, 256, num_layers=2, batch_first=True)
        self.fc = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.lstm(self.embedding(x))[0][:, -1])


def engine_for(dataset: str, model: str, kernel: str, steps: int):
    cfg = load_settings([f"dataset={dataset}", "dataset.num_clients=20", f"algorithm.clients_per_round={K}",
                         f"algorithm.local_steps={steps}", f"algorithm.batch_size={BATCH}", "algorithm.client_lr=0.5",
                         f"model={model}", f"kernel={kernel}", "memory_budget_gb=0.5", "progress=false"])
    problem, algorithm = build_parts(cfg)  # not prepare_run: the process's threads stay the benchmark's
    engine = build_engine(Prepared(cfg, problem, algorithm, None, *build_series(cfg.replicas)),
                          InlineExecutor(problem, algorithm.solver))
    return engine, engine.step(engine.initial_state())  # the warm-up round, not timed


VARIANTS = [  # (label, data set, model, kernel)
    ("char_lstm, functional LSTM, vectorized (vmap)", "shakespeare_shaped", "char_lstm", "vmap"),
    ("char_lstm, functional LSTM, per client (loop)", "shakespeare_shaped", "char_lstm", "loop"),
    ("nn.LSTM (fused), per client (loop)", "shakespeare_shaped", "torch_char_lstm", "loop"),
    ("nn.LSTM under vmap (batching fallback)", "shakespeare_shaped", "torch_char_lstm", "vmap"),
    ("femnist_cnn, vectorized (vmap)", "femnist_shaped", "femnist_cnn", "vmap"),
    ("femnist_cnn, per client (loop)", "femnist_shaped", "femnist_cnn", "loop"),
    ("femnist_cnn, per client, channels-last", "femnist_shaped", "femnist_cnn", "loop_channels_last"),
    ("char_lstm, torch's fused LSTM, per client, plain autograd (fused)", "shakespeare_shaped", "char_lstm", "fused"),
]

OUT = Path(__file__).parent / "out"
STEP_CLIENTS, CHAR_BATCH, WORD_BATCH, WORD_SEQ, WORD_VOCAB = 3, 24, 16, 20, 10_004
PEAK_STEPS = 5  # steps a peak-memory process takes


def peak_mb() -> float:
    """This process's peak RSS in MB: VmHWM, which exec resets (ru_maxrss keeps the forking parent's peak)."""
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class TorchText(nn.Module):
    """A text net (char_lstm, word_lstm) rebuilt on torch.nn.LSTM with its weights (bias_ih = its one bias, bias_hh
    = 0): what a torch user writes. Pad tokens (the net's pad_id) are skipped by packing each sequence's words."""

    def __init__(self, net: nn.Module):
        super().__init__()
        layers = net.lstm.layers
        self.embedding = copy.deepcopy(net.embedding)
        self.lstm = nn.LSTM(layers[0].weight_ih.shape[1], layers[0].hidden_size, len(layers), batch_first=True)
        with torch.no_grad():
            for k, layer in enumerate(layers):
                for mine, theirs in (("weight_ih", layer.weight_ih), ("weight_hh", layer.weight_hh),
                                     ("bias_ih", layer.bias)):
                    getattr(self.lstm, f"{mine}_l{k}").copy_(theirs)
                getattr(self.lstm, f"bias_hh_l{k}").zero_()
        self.head = copy.deepcopy(nn.Sequential(net.projection, net.fc) if hasattr(net, "projection") else net.fc)
        self.pad_id = getattr(net, "pad_id", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embedding(x)
        if self.pad_id is None:
            return self.head(self.lstm(e)[1][0][-1])
        kept = (x != self.pad_id).sum(1).clamp(min=1)  # the data pad after the words
        packed = nn.utils.rnn.pack_padded_sequence(e, kept.cpu(), batch_first=True, enforce_sorted=False)
        return self.head(self.lstm(packed)[1][0][-1])


def reference_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> None:
    """The plain reference of one local step: each client's minibatch gradient by loss.backward(), client by client."""
    for m, model in enumerate(models):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x[m]), y[m]).backward()


def step_work(kind: str) -> tuple[NetObjective, torch.Tensor, torch.Tensor]:
    """The harness's objective and one step's minibatches [3, b, T] of token ids and labels: char windows, or
    StackOverflow-shaped sentences of 5-20 words padded with 0 to 20."""
    gen = torch.Generator().manual_seed(0)
    if kind == "char":
        net, shape, classes = build_net("char_lstm", (80,), 80), (80,), 80
        x = torch.randint(0, 80, (STEP_CLIENTS, CHAR_BATCH, 80), generator=gen)
    else:
        net, shape, classes = build_net("word_lstm", (WORD_SEQ,), WORD_VOCAB), (WORD_SEQ,), WORD_VOCAB
        x = torch.randint(1, WORD_VOCAB, (STEP_CLIENTS, WORD_BATCH, WORD_SEQ), generator=gen)
        words = torch.randint(5, WORD_SEQ + 1, x.shape[:2], generator=gen)
        x[torch.arange(WORD_SEQ) >= words[..., None]] = 0
    objective = NetObjective(net, f"{kind}_lstm", 0.0, shape, tokens=True)
    y = torch.randint(0, classes, x.shape[:2], generator=gen)
    return objective, x, y


def step_variants(kind: str) -> dict:
    """label -> a callable running one local step of `kind`'s work."""
    objective, x, y = step_work(kind)
    w = objective.init(1, 0, torch.float32).expand(STEP_CLIENTS, -1).contiguous()
    models = [TorchText(objective.net) for _ in range(STEP_CLIENTS)]

    def harness(kernel: str):
        def run():
            objective.kernel = kernel
            objective.batch_grad(w, (x, y))
        return run

    variants = {f"{kind}: harness kernel={k}": harness(k) for k in ("fused", "vmap", "loop")}
    variants[f"{kind}: nn.LSTM, plain autograd, per client"] = lambda: reference_step(models, x, y)
    return variants


def peak_of(label: str, threads: int) -> float:
    """Peak RSS (MB) of a fresh process running PEAK_STEPS steps of one variant."""
    out = subprocess.run([sys.executable, __file__, "--peak", label, "--threads", str(threads)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mb"]


def section_step(args) -> dict:
    result = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        variants = {**step_variants("char"), **step_variants("word")}
        for run in variants.values():
            run()  # warm-up
        seconds: dict[str, list[float]] = {label: [] for label in variants}
        before = load()
        for _ in range(args.repeats):
            for label, run in variants.items():
                start = time.perf_counter()
                run()
                seconds[label].append(time.perf_counter() - start)
        after = load()
        peaks = {label: peak_of(label, threads) for label in variants}
        medians = {label: statistics.median(s) for label, s in seconds.items()}
        ref = {kind: medians[f"{kind}: nn.LSTM, plain autograd, per client"] for kind in ("char", "word")}
        print(f"step, {threads} thread(s), median of {args.repeats}, load {before} -> {after}")
        for label, med in medians.items():
            print(f"  {label:44s} {med * 1e3:9.0f} ms  {med / ref[label.split(':')[0]]:5.2f}x  "
                  f"peak {peaks[label]:6.0f} MB", flush=True)
        result[f"threads={threads}"] = {"load_before": before, "load_after": after, "repeats": args.repeats,
                                        "ms": {k: 1e3 * v for k, v in medians.items()},
                                        "all_ms": {k: [1e3 * t for t in v] for k, v in seconds.items()},
                                        "peak_mb": peaks}
    return result


def peak_main(label: str, threads: int) -> None:
    torch.set_num_threads(threads)
    run = step_variants(label.split(":")[0])[label]
    for _ in range(PEAK_STEPS):
        run()
    print(json.dumps({"peak_mb": peak_mb()}))


LEAF_TRAIN, LEAF_TEST = (40, 42, 44, 45, 46, 48), (8, 10, 12, 13, 14, 16)  # 265 training windows


def leaf_windows(seed: int = 0) -> dict:
    """Six speaking roles' windows of 80 characters of LEAF's alphabet and the next character, train and test."""
    rng = np.random.default_rng(seed)
    out: dict = {"train": {}, "test": {}}
    for i, (n_train, n_test) in enumerate(zip(LEAF_TRAIN, LEAF_TEST)):
        n = n_train + n_test
        text = "".join(rng.choice(list(LETTERS), n + 80))
        xs, ys = [text[j:j + 80] for j in range(n)], [text[j + 80] for j in range(n)]
        role = f"THE_TEMPEST_ROLE{i}"
        out["train"][role], out["test"][role] = (xs[:n_train], ys[:n_train]), (xs[n_train:], ys[n_train:])
    return out


def write_leaf_folder(root: Path) -> None:
    """LEAF's layout: train/ and test/ JSON files of users, user_data x (windows) and y (next characters)."""
    for split, users in leaf_windows().items():
        (root / split).mkdir(parents=True, exist_ok=True)
        doc = {"users": list(users), "num_samples": [len(v[0]) for v in users.values()],
               "user_data": {u: {"x": v[0], "y": v[1]} for u, v in users.items()}}
        (root / split / f"all_data_0_niid_0_keep_0_{split}_9.json").write_text(json.dumps(doc))


def reference_rounds_main(threads: int) -> None:
    """The 6-user run's rounds on torch.nn.LSTM by plain autograd: 3 rounds of 3 clients x 20 SGD steps of 24
    windows (lr 0.05, FedAvg's weighted average), 4 evaluations (training loss and its gradient over every training
    window, test loss under no_grad)."""
    start = time.perf_counter()
    torch.set_num_threads(threads)
    ids = {c: i for i, c in enumerate(LETTERS)}
    data = {split: [(torch.tensor([[ids[c] for c in w] for w in xs]), torch.tensor([ids[c] for c in ys]))
                    for xs, ys in users.values()] for split, users in leaf_windows().items()}
    torch.manual_seed(0)
    model = TorchText(build_net("char_lstm", (80,), len(LETTERS)))
    rng = np.random.default_rng(0)

    def evaluate() -> None:
        x, y = (torch.cat(t) for t in zip(*data["train"]))
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            xt, yt = (torch.cat(t) for t in zip(*data["test"]))
            nn.functional.cross_entropy(model(xt), yt)

    evaluate()
    for _ in range(3):
        clients, new = rng.choice(len(data["train"]), 3, replace=False), []
        for c in clients:
            local = copy.deepcopy(model)
            opt = torch.optim.SGD(local.parameters(), lr=0.05)
            x, y = data["train"][c]
            for _ in range(20):
                take = torch.from_numpy(rng.choice(len(y), CHAR_BATCH))
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(local(x[take]), y[take]).backward()
                opt.step()
            new.append((len(y), local.state_dict()))
        total = sum(n for n, _ in new)
        model.load_state_dict({k: sum(n * sd[k] for n, sd in new) / total for k in new[0][1]})
        evaluate()
    print(json.dumps({"compute_s": time.perf_counter() - start,
                      "peak_mb": peak_mb()}))


HARNESS_RUN = ("import json, sys; from fedharness.cli import main; rc = main(sys.argv[1:]); status = open("
               "'/proc/self/status').read().split('VmHWM:')[1].split()[0]; "
               "print(json.dumps({'rc': rc, 'peak_mb': int(status) / 1024}))")


def timed_process(command: list[str], env: dict) -> dict:
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{command[:4]} failed:\n{done.stderr[-3000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - start}


def section_leaf(args) -> dict:
    folder = OUT / "leaf6"
    write_leaf_folder(folder)
    result = {}
    for threads in (1, 2):
        runs: dict[str, list[dict]] = {"harness": [], "reference": []}
        before = load()
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "FEDHARNESS_CACHE": f"{tmp}/cache"}  # a cold kernel cache
                runs["harness"].append(timed_process(
                    [sys.executable, "-c", HARNESS_RUN, "run", "dataset=leaf", f"dataset.path={folder}", "rounds=3",
                     "eval_every=1", "algorithm.clients_per_round=3", f"threads={threads}",
                     f"dataset.cache_dir={tmp}/data", f"results_dir={tmp}/results", "progress=false"], env))
            runs["reference"].append(timed_process(
                [sys.executable, __file__, "--reference-rounds", "--threads", str(threads)], dict(os.environ)))
        after = load()
        summary = {name: {"wall_s": statistics.median(r["wall_s"] for r in rs),
                          "peak_mb": max(r["peak_mb"] for r in rs)} for name, rs in runs.items()}
        ratio = summary["harness"]["wall_s"] / summary["reference"]["wall_s"]
        print(f"6-user LEAF folder, 3 rounds, threads={threads}, median of {args.runs} runs, load {before} -> "
              f"{after}: harness {summary['harness']['wall_s']:.1f} s (peak {summary['harness']['peak_mb']:.0f} MB), "
              f"nn.LSTM reference {summary['reference']['wall_s']:.1f} s (peak "
              f"{summary['reference']['peak_mb']:.0f} MB): {ratio:.2f}x", flush=True)
        result[f"threads={threads}"] = {"load_before": before, "load_after": after, "runs": runs,
                                        "median": summary, "ratio": ratio}
    return result


def section_rounds(args) -> dict:
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="There is a performance drop")  # nn.LSTM under vmap, said above
    fedharness.register_dataset("shakespeare_shaped", shakespeare_shaped, num_clients=20)
    fedharness.register_dataset("femnist_shaped", femnist_shaped, num_clients=20)
    fedharness.register_model("torch_char_lstm", TorchCharLSTM)
    running = {label: engine_for(dataset, model, kernel, args.steps) for label, dataset, model, kernel in VARIANTS}
    wall: dict[str, list[float]] = {label: [] for label in running}
    cpu: dict[str, list[float]] = {label: [] for label in running}
    for _ in range(args.rounds):
        for label, (engine, state) in running.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            running[label] = (engine, engine.step(state))
            wall[label].append(time.perf_counter() - start)
            cpu[label].append(time.process_time() - start_cpu)
    ms = {label: 1e3 * statistics.median(s) for label, s in wall.items()}
    cpu_ms = {label: 1e3 * statistics.median(s) for label, s in cpu.items()}
    print(f"{'':48s} {'wall ms/round':>14s} {'CPU ms/round':>13s}")
    for label in ms:
        print(f"{label:48s} {ms[label]:14.0f} {cpu_ms[label]:13.0f}", flush=True)
    return {"threads": args.threads, "load_average": os.getloadavg(), "rounds": args.rounds,
            "local_steps": args.steps, "ms_per_round": ms, "cpu_ms_per_round": cpu_ms}


SECTIONS = {"rounds": section_rounds, "step": section_step, "leaf": section_leaf}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7, help="step: timed steps of each variant")
    parser.add_argument("--runs", type=int, default=3, help="leaf: processes of each kind and thread count")
    parser.add_argument("--peak", help=argparse.SUPPRESS)  # internal: one variant's peak RSS
    parser.add_argument("--reference-rounds", action="store_true", help=argparse.SUPPRESS)  # internal
    args = parser.parse_args()
    if args.peak:
        return peak_main(args.peak, args.threads)
    if args.reference_rounds:
        return reference_rounds_main(args.threads)
    out = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__}
    for name in args.sections.split(","):
        out[name] = SECTIONS[name](args)
    OUT.mkdir(exist_ok=True)
    (OUT / "text_models.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
