"""`make mutants [MODULE=name]`: cosmic-ray over the modules where a silent error is costly (docs/mutation.md).

cosmic-ray mutates the source file in place, so the editable install (harness/ as fedharness) imports the mutant
as it is; each mutant runs its module's fast tests (TARGETS) in a child of mutation/forkserver.py, which has
torch imported already. Before the generated mutants, the mutations issue 35 listed (LISTED) are applied by hand,
as cosmic-ray's operators do not generate most of them: each must make the module's tests fail.
Output: a table per module and every survivor with its diff; the sessions stay in mutation/sessions/.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SESSIONS = ROOT / "mutation" / "sessions"
# cosmic-ray's commands as modules of this Python: a worktree's light venv has the packages but not their scripts
COSMIC_RAY = [sys.executable, "-m", "cosmic_ray.cli"]
FILTER_OPERATORS = [sys.executable, "-m", "cosmic_ray.tools.filters.operators_filter"]


@dataclass(frozen=True)
class Target:
    paths: tuple[str, ...]  # the files mutated
    tests: tuple[str, ...]  # pytest arguments: the fast tests that guard them


TARGETS: dict[str, Target] = {
    "privacy": Target(("algorithms/privacy.py",), (
        "tests/test_privacy.py", "tests/test_mutation_kills.py", "-k", "poisson_sampling_takes or noise_std "
        "or adaptive_clipping or engine_adds or released_unclipped or final_epsilon or cannot_change "
        "or clip_rows or shards_clip_each")),
    "accounting": Target(("algorithms/accounting.py",), (
        "tests/test_privacy.py", "tests/test_mutation_kills.py", "tests/test_privacy_defaults.py", "-k",
        "rdp_and_pld or target_epsilon_is_reached or studys_trials_compose or spends_nothing or root_handler")),
    "samplers": Target(("algorithms/samplers.py",), (
        "tests/test_samplers.py", "tests/test_privacy.py", "tests/test_mutation_kills.py", "tests/test_unseen_clients.py",
        "-k", "full_participation_trains or unbiased or original_scheme or scheme_ii_weights or yang_strategies or depend_only or dropout_rescales "
        "or dropout_is_keyed or poisson or bad_sampler or beyond_the_shuffle or wraps_the_sampler "
        "or declares_with_replacement or online or offline")),
    "attacks": Target(("algorithms/attacks.py", "algorithms/byzantine.py"), (
        "tests/test_attacks.py", "tests/test_mutation_kills.py", "tests/test_personalization_table.py", "-k",
        "fixed_byzantine or equals_numpy or gaussian_noise or read_what "
        "or byzantine_set or continued_from or label_flip or zero_strength or labels_alone or one_honest "
        "or without_byzantine or as_a_stage or poisoned_clients_work")),
    "exact_sum": Target(("harness/core/exact_sum.py",), (
        "tests/test_compact_sums.py", "tests/test_same_bits.py",
        "tests/test_mutation_kills.py::test_a_sum_converted_in_several_column_chunks_is_within_the_documented_precision",
        "tests/test_mutation_kills.py::test_a_sum_pickled_as_ray_sends_it_or_moved_arrives_whole_and_counts_its_bytes",
        "tests/test_mutation_kills.py::test_each_named_sum_gets_the_grid_of_what_it_updates",
        "tests/test_mutation_kills.py::test_terms_within_the_margin_travel_in_the_low_word_alone_and_the_words_are"
        "_the_documented_ones",
        "-k", "not cnn and not switch and not rows")),
    "robust": Target(("algorithms/robust.py",), (
        "tests/test_robust_aggregators.py", "tests/test_rfa_cclip.py", "tests/test_mutation_kills.py", "-k",
        "known_updates or multi_krum or budgeted_chunks or geometric_median or centered_clip or bucketing "
        "or degenerate_settings or buckets_of_one or krum_breaks_ties")),
    "optuna_parts": Target(("harness/studies/tuning/optuna_parts.py",), (
        "tests/test_tune_samplers.py", "tests/test_tune_errors.py", "tests/test_mutation_kills.py", "-k",
        "next_batch or constant_liar or batched_tpe or cmaes or continuing_a_study_with_another_budget "
        "or enqueued_trial_first or opens_only")),
}

# cosmic-ray's operators, less what would triple the budget for little: each binary and comparison operator is
# replaced by its one natural counterpart (+ by -, < by <=, == by !=; most of a site's other nine or ten
# replacements fail to run at all); no `|` (in these modules only in annotations, which `from __future__ import
# annotations` never evaluates); no number +-1 (mostly sizes and key bounds; the grid's MARGIN_BITS is in
# LISTED); decorators kept (removing @dataclass only breaks the import); no random-constant variable operators.
KEPT = ("Add_Sub", "Sub_Add", "Mul_Div", "Div_Mul", "FloorDiv_Div", "Pow_Mul", "Mod_FloorDiv", "BitAnd_BitOr",
        "LShift_RShift", "RShift_LShift")
KEPT_COMPARISONS = ("Eq_NotEq", "NotEq_Eq", "Lt_LtE", "LtE_Lt", "Gt_GtE", "GtE_Gt", "Is_IsNot", "IsNot_Is",
                    "In_NotIn", "NotIn_In")
EXCLUDED_OPERATORS = (
    rf"core/ReplaceBinaryOperator_(?!({'|'.join(KEPT)})$)",
    rf"core/ReplaceComparisonOperator_(?!({'|'.join(KEPT_COMPARISONS)})$)",
    r"core/ReplaceUnaryOperator_(?!(USub_UAdd|Delete_Not)$)",
    r"core/RemoveDecorator", r"core/VariableReplacer", r"core/VariableInserter", r"core/NumberReplacer",
)


@dataclass(frozen=True)
class Listed:
    """One of issue 35's mutations: `old` (found exactly once in `path`) replaced by `new`."""

    module: str
    what: str
    path: str
    old: str
    new: str


LISTED: tuple[Listed, ...] = (
    Listed("privacy", "adaptive clipping: the update's noise uses z, not z_update", "algorithms/privacy.py",
           "std = self.update_noise * ", "std = self.noise_multiplier * "),
    Listed("privacy", "the released unclipped count gets no noise", "algorithms/privacy.py",
           "(unclipped + self.count_noise * streams.normal(key, 1)[:, 0])", "(unclipped + 0.0)"),
    Listed("samplers", "Poisson rate K/(N+1) instead of K/N", "algorithms/samplers.py",
           "return self.K / self.num_clients", "return self.K / (self.num_clients + 1)"),
    Listed("exact_sum", "the compact-sum grid 2x coarser", "harness/core/exact_sum.py",
           "MARGIN_BITS = 2 ", "MARGIN_BITS = 3 "),
    Listed("exact_sum", "the compact-sum grid 16x coarser", "harness/core/exact_sum.py",
           "MARGIN_BITS = 2 ", "MARGIN_BITS = 6 "),
    Listed("exact_sum", "terms beyond the words not saturated", "harness/core/exact_sum.py",
           "if not bool(fits.all()):", "if False:"),
    Listed("optuna_parts", "batched TPE without constant liar", "harness/studies/tuning/optuna_parts.py",
           "constant_liar=True", "constant_liar=False"),
)


HEADER = f"{'module':<12} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'listed':>7} {'minutes':>7}"
ROW = "{:<12} {:>7} {:>6} {:>7} {:>8} {:>7} {:>7.1f}"


def main(argv: list[str]) -> int:
    names = argv or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        print(f"mutants: MODULE={unknown[0]!r} is not one of {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    SESSIONS.mkdir(exist_ok=True)
    started = time.monotonic()
    rows = []
    for name in names:
        rows.append(run_module(name, TARGETS[name]))
        print(ROW.format(*rows[-1]), flush=True)
    print("\n" + HEADER)
    for row in rows:
        print(ROW.format(*row))
    print(f"total {(time.monotonic() - started) / 60:.1f} minutes")
    return 0


def run_module(name: str, target: Target) -> tuple:
    started = time.monotonic()
    socket_path, log = SESSIONS / f"{name}.sock", SESSIONS / f"{name}.runs"
    socket_path.unlink(missing_ok=True)
    log.unlink(missing_ok=True)
    options = ["-x", "-q", "-p", "no:cacheprovider", "-p", "pytest_timeout", "--assert=plain"]
    config = SESSIONS / f"{name}.server.json"
    config.write_text(json.dumps({"args": [*options, *target.tests], "options": len(options),
                                  "paths": list(target.paths), "calls": str(SESSIONS / f"{name}.calls.json"),
                                  "log": str(log)}))
    server = subprocess.Popen([sys.executable, str(ROOT / "mutation" / "forkserver.py"), "serve", str(socket_path),
                               str(config)], cwd=ROOT)
    try:
        while not socket_path.exists():
            if server.poll() is not None:
                raise SystemExit(f"mutants: the fork server for {name} exited ({server.returncode})")
            time.sleep(0.2)
        client = [sys.executable, str(ROOT / "mutation" / "forkserver.py"), "run", str(socket_path)]
        baseline = _baseline(name, client)
        listed = _listed(name, client, baseline)
        results = _cosmic_ray(name, target, client, timeout=max(60.0, 5 * baseline))
        if server.poll() is not None:  # its clients then failed to connect: not a test that failed
            raise SystemExit(f"mutants: the fork server for {name} died during the run: its results are void")
    finally:
        server.terminate()
        server.wait()
        socket_path.unlink(missing_ok=True)
        changed = subprocess.run(["git", "diff", "--quiet", "--", *target.paths], cwd=ROOT).returncode
        if changed:
            raise SystemExit(f"mutants: {' '.join(target.paths)} differ from git after the run: check them")
    killed = sum(r == "killed" for r in results.values())
    timeouts = sum(r == "timeout" for r in results.values())
    survived = [job for job, r in results.items() if r == "survived"]
    print(f"{name}: {_where_time_went(log)}", flush=True)
    return (name, len(results), killed, timeouts, len(survived), listed, (time.monotonic() - started) / 60)


def _where_time_went(log: Path) -> str:
    """The fork server's runs summed by how each ended (forkserver.py: first stage, rest of the selection, the
    whole selection at once, timeouts); the module's time beyond them is cosmic-ray's and the clients'."""
    totals: dict[str, list[float]] = {}
    for line in log.read_text().splitlines():
        seconds, status, stage, _ = line.split()
        kind = "timeout" if status == "-1" else f"{stage} {'killed' if status != '0' else 'passed'}"
        totals.setdefault(kind, [0, 0.0])
        totals[kind][0] += 1
        totals[kind][1] += float(seconds)
    return "; ".join(f"{kind}: {n} runs, {s:.0f} s" for kind, (n, s) in sorted(totals.items()))


def _baseline(name: str, client: list[str]) -> float:
    started = time.monotonic()  # the first run also records which tests call each function (forkserver.py)
    done = subprocess.run(client, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mutants: {name}'s tests fail without a mutant:\n{done.stdout[-3000:]}")
    seconds = time.monotonic() - started
    print(f"{name}: the unmutated tests pass in {seconds:.1f} s", flush=True)
    return seconds


def _listed(name: str, client: list[str], baseline: float) -> str:
    """Applies each of the module's LISTED mutations by hand: "killed/of", or exits naming one that survived."""
    mine = [m for m in LISTED if m.module == name]
    for mutation in mine:
        path = ROOT / mutation.path
        source = path.read_text()
        if source.count(mutation.old) != 1:
            raise SystemExit(f"mutants: {mutation.path} no longer holds {mutation.old!r} once: update LISTED")
        try:
            path.write_text(source.replace(mutation.old, mutation.new))
            done = subprocess.run(client, cwd=ROOT, capture_output=True, text=True, timeout=max(60, 5 * baseline))
        finally:
            path.write_text(source)
        if done.returncode == 0:
            raise SystemExit(f"mutants: the listed mutation survived: {mutation.what} ({mutation.path})")
        print(f"{name}: listed mutation killed: {mutation.what}", flush=True)
    return f"{len(mine)}/{len(mine)}"


def _cosmic_ray(name: str, target: Target, client: list[str], timeout: float) -> dict[str, str]:
    """Runs cosmic-ray's session for `name`; each kept mutant's outcome: killed, timeout or survived."""
    config, session = SESSIONS / f"{name}.toml", SESSIONS / f"{name}.sqlite"
    config.write_text(
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(list(target.paths))}\n"
        f"timeout = {timeout:.0f}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(shlex.join(client))}\n"
        "[cosmic-ray.distributor]\nname = \"local\"\n"
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = {json.dumps(list(EXCLUDED_OPERATORS))}\n")
    session.unlink(missing_ok=True)
    subprocess.run([*COSMIC_RAY, "init", config, session], cwd=ROOT, check=True)
    subprocess.run([*FILTER_OPERATORS, session, config], cwd=ROOT, check=True)
    print(f"{name}: {_pending(session)} mutants, {timeout:.0f} s timeout each", flush=True)
    subprocess.run([*COSMIC_RAY, "exec", config, session], cwd=ROOT, check=True)
    return _outcomes(name, session)


def _pending(session: Path) -> int:
    dump = subprocess.run([*COSMIC_RAY, "dump", session], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout
    return sum(json.loads(line)[1] is None for line in dump.splitlines())


def _outcomes(name: str, session: Path) -> dict[str, str]:
    dump = subprocess.run([*COSMIC_RAY, "dump", session], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout
    outcomes = {}
    for line in dump.splitlines():
        item, result = json.loads(line)
        if result is None or result["worker_outcome"] == "skipped":
            continue
        outcome = "timeout" if result["output"] == "timeout" else result["test_outcome"]
        outcomes[item["job_id"]] = outcome
        if outcome != "killed" and outcome != "timeout":
            where = item["mutations"][0]
            print(f"\n{name}: {outcome.upper()} {where['module_path']}:{where['start_pos'][0]} "
                  f"{where['operator_name']} in {where['definition_name']}\n{result['diff']}", flush=True)
    return outcomes


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
