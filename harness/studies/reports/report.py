"""Build the report: tables (also CSV under report/tables/), PNG figures (report/figures/), report.md."""

from __future__ import annotations

import datetime as _dt
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from fedharness.errors import require
from fedharness.studies.reports import analysis, markdown, plots
from fedharness.studies.reports.analysis import Design, Target, parse_target
from fedharness.studies.reports.data import Results, check_scale_key, report_dir, varying_keys

DEFAULT_SCALE_KEY = "algorithm.clients_per_round"


@dataclass
class Report:
    out_dir: Path
    markdown: Path
    design: Design
    targets: list[Target]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    figures: dict[str, Path] = field(default_factory=dict)


def _defaults(results: Results, targets: list[Target] | None, scale_key: str | None, bootstrap: int | None):
    """Command-line values win; otherwise the sweeps' own `report:` settings (from their manifests)."""
    specs = [m.get("spec", {}).get("report", {}) for m in results.manifests]
    if targets is None:
        texts = list(dict.fromkeys(t for s in specs for t in (s.get("targets") or [])))
        targets = [parse_target(t) for t in texts]
    if scale_key is None:
        keys = list(dict.fromkeys(s.get("scale_key") for s in specs if s.get("scale_key")))
        require(len(keys) <= 1, "--scale-key", None, f"the sweeps in this directory disagree ({', '.join(keys)}); "
                "pick one")
        scale_key = keys[0] if keys else DEFAULT_SCALE_KEY
    if bootstrap is None:
        bootstrap = next((int(s["bootstrap"]) for s in specs if s.get("bootstrap")), 1000)
    return targets, scale_key, bootstrap


def _runs_table(results: Results, labels: pd.DataFrame) -> pd.DataFrame:
    runs = results.runs.merge(labels[["run_id", "group", "n"]], on="run_id")
    cols = ["run_id", "study", "algorithm", "group", "n", "status", "n_replicas", "rounds_done", "error"]
    out = runs[[c for c in cols if c in runs.columns]].copy()
    out["error"] = out["error"].fillna("").map(lambda e: e.splitlines()[0][:160] if e else "")
    return out.sort_values(["group", "n", "run_id"]).reset_index(drop=True)


def _groups_table(results: Results, labels: pd.DataFrame, design: Design) -> pd.DataFrame:
    """Each group with every varying key that is constant within it (so zipped or tied keys are visible)."""
    keys = [k for k in varying_keys(results.runs) if k != design.scale_key]
    rows = []
    for group, ids in labels.groupby("group", sort=False)["run_id"]:
        cfgs = results.runs[results.runs["run_id"].isin(set(ids))]["cfg"]
        row = {"group": group}
        for k in keys:
            vals = {str(c.get(k)) for c in cfgs}
            row[k] = vals.pop() if len(vals) == 1 else "varies with n"
        rows.append(row)
    return pd.DataFrame(rows)


def build_report(results: Results, targets: list[Target] | None = None, scale_key: str | None = None,
                 out_dir: str | Path | None = None, bootstrap: int | None = None, level: float = 0.95,
                 series: str = "iterate", metrics: list[str] | None = None, figures: bool = True) -> Report:
    """Tables (and CSV), figures unless `figures=False` (analysis only), and report.md, of `results`
    (data.load_results).

    Every argument is checked before any file; the report is built in a staging folder and moved into place
    only when complete, so an error leaves no half-written report (and no empty tables/ or figures/)."""
    targets, scale_key, bootstrap = _defaults(results, targets, scale_key, bootstrap)
    require(0 < level < 1, "--level", level, "must be in (0, 1)")
    require(bootstrap >= 1, "--bootstrap", bootstrap, "must be an integer >= 1")
    check_scale_key(results.runs, scale_key)
    final = Path(out_dir) if out_dir is not None else report_dir(results.store)
    stage = Path(tempfile.mkdtemp(prefix=f".{final.name}-", suffix=".tmp",
                                  dir=final.parent if final.parent.is_dir() else None))
    try:
        report = _write_report(results, targets, scale_key, stage, bootstrap, level, series, metrics, figures)
        _publish(stage, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    report.out_dir, report.markdown = final, final / "report.md"
    report.figures = {name: final / path.relative_to(stage) for name, path in report.figures.items()}
    return report


def _publish(stage: Path, final: Path) -> None:
    """Move the staged files into `final` (replacing files of an earlier report, keeping anything else)."""
    for src in sorted(p for p in stage.rglob("*") if p.is_file()):
        dest = final / src.relative_to(stage)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dest)


def _write_report(results: Results, targets: list[Target], scale_key: str, out: Path, bootstrap: int, level: float,
                  series: str, metrics: list[str] | None, figures: bool) -> Report:
    (out / "figures").mkdir()
    (out / "tables").mkdir()
    labels, design = analysis.run_labels(results, scale_key)
    report = Report(out, out / "report.md", design, targets)
    report.tables["runs"] = _runs_table(results, labels)
    report.tables["groups"] = _groups_table(results, labels, design)
    metrics = metrics or list(dict.fromkeys([t.metric for t in targets] or ["train_loss"]))
    for metric in metrics if figures else []:
        curves = analysis.curves(results, labels, metric, series)
        if not len(curves):
            continue
        target = next((t for t in targets if t.metric == metric), None)
        report.figures[f"convergence_{metric}"] = plots.convergence(
            curves, metric, scale_key, target, out / "figures" / f"convergence_{metric}.png")
        report.figures[f"collapse_{metric}"] = plots.collapse(
            curves, metric, target, out / "figures" / f"collapse_{metric}.png")
        report.figures[f"communication_{metric}"] = plots.convergence(
            curves, metric, scale_key, target, out / "figures" / f"communication_{metric}.png", x="mb")
    spread = analysis.client_spread(results, labels, series)
    if len(spread):  # eval.per_client: how accuracy is spread over the clients
        report.tables["client_acc"] = spread
        if figures:
            report.figures["client_acc"] = plots.client_spread(spread, scale_key, out / "figures" / "client_acc.png")
    for target in targets:
        ttt = analysis.time_to_target(results, target, series)
        cells = analysis.cell_table(ttt, labels)
        fits = analysis.fit_table(ttt, labels, cells, bootstrap, level)
        report.tables[f"replicas_{target.slug}"] = ttt.merge(labels, on="run_id")
        report.tables[f"to_target_{target.slug}"] = cells
        report.tables[f"speedup_{target.slug}"] = analysis.speedup_table(cells)
        report.tables[f"fit_{target.slug}"] = fits
        if on_the_clock(results):  # the systems clock or a compute model ran: time to target in seconds too
            report.tables[f"speedup_sim_s_{target.slug}"] = analysis.speedup_table(cells, "sim_s")
            report.tables[f"fit_sim_s_{target.slug}"] = analysis.fit_table(ttt, labels, cells, bootstrap, level,
                                                                           "sim_s")
            if len(cells) and figures:
                report.figures[f"speedup_sim_s_{target.slug}"] = plots.speedup(
                    cells, report.tables[f"fit_sim_s_{target.slug}"], target, scale_key,
                    out / "figures" / f"speedup_sim_s_{target.slug}.png", time="sim_s")
        if len(cells) and figures:
            report.figures[f"speedup_{target.slug}"] = plots.speedup(
                cells, fits, target, scale_key, out / "figures" / f"speedup_{target.slug}.png")
            report.figures[f"cost_{target.slug}"] = plots.cost_to_target(
                cells, target, scale_key, out / "figures" / f"cost_{target.slug}.png")
    for name, df in report.tables.items():
        df.to_csv(out / "tables" / f"{name}.csv", index=False)
    report.markdown.write_text(render_markdown(report, results, level))
    return report


def on_the_clock(results: Results) -> bool:
    """Whether the runs' simulated clock moved (sim_s > 0 somewhere): a speedup in seconds then means something."""
    r = results.rounds
    return bool(len(r)) and "sim_s" in r.columns and bool((r["sim_s"].astype(float) > 0).any())


def _fig(report: Report, name: str) -> str:
    path = report.figures.get(name)
    return "" if path is None else f"![{name}]({path.relative_to(report.out_dir).as_posix()})\n"


def _target_section(report: Report, t, level: float) -> list[str]:
    """One target's section: censored replicas, rounds/MB/seconds to target, speedup, the fit, its figures."""
    cells = report.tables[f"to_target_{t.slug}"]
    fits = report.tables[f"fit_{t.slug}"]
    sp = report.tables[f"speedup_{t.slug}"]
    total_c, total = int(cells["censored"].sum()), int(cells["replicas"].sum())
    return [f"## Target `{t.label}`", "",
           f"**Censored: {total_c} of {total} replicas** never reached the target "
           f"({', '.join(f'{r.group} n={r.n:g}: {r.censored}' for r in cells.itertuples() if r.censored) or 'none'}).",
           "", "### Rounds, MB and seconds to target (median over seeds and replicas)", "",
           markdown.table(cells, ["group", "algorithm", "n", "runs", "replicas", "reached", "censored", "rounds",
                                  "rounds_mean", "rounds_std", "local_steps", "MB", "sim_s"],
                          {"rounds_mean": "mean (reached)", "rounds_std": "std (reached)",
                           "sim_s": "seconds (sim)"}), "",
           "### Speedup S(n) = T(n0) / T(n) and efficiency S(n) n0 / n", "",
           markdown.table(sp, ["group", "n", "rounds", "speedup", "efficiency", "censored"]), "",
           f"### Fit T = a n^-b ({level:.0%} bootstrap interval over seeds)", "",
           markdown.table(fits, ["group", "points", "left_out", "a", "b", "b_lo", "b_hi", "bootstrap"],
                          {"left_out": "n not fitted", "b_lo": "b low", "b_hi": "b high",
                           "bootstrap": "usable resamples"}), "",
           "b = 1 is linear speedup; a resample is unusable when a cell's median becomes censored.", "",
           _fig(report, f"speedup_{t.slug}"), _fig(report, f"cost_{t.slug}"), *_seconds_section(report, t, level)]


def _seconds_section(report: Report, t, level: float) -> list[str]:
    """The speedup and fit with T in simulated seconds (sim_s), where the clock moved."""
    sp, fits = report.tables.get(f"speedup_sim_s_{t.slug}"), report.tables.get(f"fit_sim_s_{t.slug}")
    if sp is None:
        return []
    return ["### In simulated seconds: speedup and fit T = a n^-b on sim_s", "",
            markdown.table(sp, ["group", "n", "sim_s", "speedup", "efficiency", "censored"],
                           {"sim_s": "seconds (sim)"}), "",
            markdown.table(fits, ["group", "points", "left_out", "a", "b", "b_lo", "b_hi", "bootstrap"],
                           {"left_out": "n not fitted", "b_lo": "b low", "b_hi": "b high",
                            "bootstrap": "usable resamples"}), "",
            f"({level:.0%} bootstrap interval over seeds.) Seconds are each replica's own clock when it first met "
            "the target: with slow and absent clients (docs/systems.md) more clients a round can cost more seconds "
            "a round, so b in seconds may fall below b in rounds.", "", _fig(report, f"speedup_sim_s_{t.slug}")]


def render_markdown(report: Report, results: Results, level: float) -> str:
    d = report.design
    runs = report.tables["runs"]
    counts = runs["status"].value_counts().to_dict()
    status = ", ".join(f"{counts[s]} {s}" for s in sorted(counts))
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# Scaling report: `{results.root}`", "",
          f"Generated by `fedharness report` on {now}. {len(runs)} runs ({status}); "
          f"studies: {', '.join(sorted(runs['study'].dropna().unique()))}.", "",
          f"* Scale variable n: `{d.scale_key}`.",
          f"* Curves are grouped by: {', '.join(f'`{k}`' for k in d.group_keys) or 'nothing (one group)'}.",
          f"* Tied to n or to the group (not a separate curve): {', '.join(f'`{k}`' for k in d.tied_keys) or 'none'}.",
          "* Time to target of a replica: the first evaluated round at which the metric is at or below the "
          "threshold (a loss) or at or above it (an accuracy). A replica that never gets there is **censored**; "
          "it counts as +infinity, so a cell's median is finite only while fewer than half of its replicas are "
          "censored. MB are the run's own byte counters (up + down, all sampled clients); seconds are the "
          "simulated wall-clock `sim_s` (bandwidth and compute model, `network.*`, and each client's speed and "
          "availability, `speed=`, `availability=`, `cadence=`).", ""]
    md += ["## Groups", "", markdown.table(report.tables["groups"]), ""]
    failed = runs[runs["status"] != "ok"]
    md += ["## Runs", "", f"{len(runs)} runs; not ok: {len(failed)}.", ""]
    if len(failed):
        md += [markdown.table(failed, ["run_id", "group", "n", "status", "rounds_done", "error"]), ""]
    if results.skipped:
        md += [f"Unreadable files, left out ({len(results.skipped)}):", "",
               *[f"* `{why}`" for why in results.skipped], ""]
    md += ["<details><summary>All runs</summary>", "", markdown.table(runs.drop(columns=["error"])), "",
           "</details>", ""]
    for t in report.targets:
        md += _target_section(report, t, level)
    md += ["## Convergence", "", "Mean over replicas with a one-standard-deviation band; the collapse plot puts "
           "n K T on the x axis, where the curves of all n coincide under linear speedup; the communication plot "
           "puts the MB sent by then (bytes_up + bytes_down: compressed updates count as encoded).", ""]
    for name in report.figures:
        if name.startswith(("convergence_", "collapse_", "communication_")):
            md.append(_fig(report, name))
    if "client_acc" in report.tables:
        last = report.tables["client_acc"].sort_values("round").groupby(["group", "n"]).tail(1)
        md += ["## Accuracy over clients", "", "Each client's accuracy on its own held-out data (`eval.per_client`): "
               "the 10th, 50th and 90th percentile over clients and their mean, averaged over replicas; the last "
               "evaluated round of each cell:", "",
               markdown.table(last, ["group", "n", "round", *analysis.CLIENT_SPREAD]), "", _fig(report, "client_acc")]
    return "\n".join(md).rstrip() + "\n"
