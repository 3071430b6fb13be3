"""`fedharness report DIR --wandb-report`: a shareable W&B Report of a study, built with `wandb-workspaces`.

The report is first written as a spec, `<report dir>/wandb_report.json`: plain JSON (title, description, the
W&B runs it shows, blocks of Markdown and of panels) that needs no network to build. Publishing turns the spec
into a `wandb_workspaces.reports.v2.Report` and saves it (GraphQL `upsertView`); it happens at once when W&B
is online (an API key, or `--wandb-mode online`) and otherwise later, from the file alone, with
`fedharness report DIR --publish` (wandb-workspaces looks the project up on the server while building a
report, so an offline report can only exist as this spec).

Runs: the W&B sink logs each run under its `run_id` as the run's name and config key, so a run set filtered on
`Config('run_id')` shows exactly the study's runs (after `wandb sync` for offline ones). Runs that were never
logged to W&B are described by the Markdown runs table only; a study with no W&B run at all gets no Report (one
error line): an empty filter would show every run of the project.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

import pandas as pd

from fedharness.config.load import load_config
from fedharness.errors import require
from fedharness.base.extras import require_extra
from fedharness.base.files import atomic_text
from fedharness.sinks.masking import mask_secrets
from fedharness.sinks.wandb_sink import resolve_mode
from fedharness.results import layout
from fedharness.results.store import ResultsStore, open_store
from fedharness.results.tables import read_table
from fedharness.studies.reports import markdown
from fedharness.studies.reports.data import Results, report_dir
from fedharness.studies.reports.report import Report
from fedharness.studies.tuning.export import shown

SPEC_FORMAT = "fedharness-wandb-report/1"
SPEC_NAME = "wandb_report.json"
LOSSES = ("train_loss", "subopt", "dist_to_opt", "grad_norm_sq", "test_loss")

log = logging.getLogger(__name__)


def _one(values: pd.Series, default: str | None) -> str | None:
    """The value all runs share (their W&B project or entity), else the default."""
    found = values.dropna().unique()
    return str(found[0]) if len(found) == 1 else default


def _trials(store: ResultsStore, studies: list[str]) -> pd.DataFrame:
    tables = [(read_table(store, layout.trials_key(s)), s) for s in studies]
    frames = [t.to_pandas().assign(study=s) for t, s in tables if t is not None]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _line(metric: str, groupby: str) -> dict:
    return {"type": "line", "title": f"{metric} against round, grouped by {groupby}", "x": "round",
            "y": [metric], "groupby": groupby, "log_y": metric in LOSSES}


def _target_blocks(report: Report) -> list[dict]:
    """Per target: final metric against n (one point per run), and the speedup fit and table as Markdown."""
    d, blocks = report.design, []
    for t in report.targets:
        fits, sp = report.tables[f"fit_{t.slug}"], report.tables[f"speedup_{t.slug}"]
        blocks.append({"markdown": "\n\n".join([
            f"## Target `{t.label}`: speedup and its fit T = a n^-b",
            markdown.table(fits, ["group", "points", "a", "b", "b_lo", "b_hi", "bootstrap"]),
            markdown.table(sp, ["group", "n", "rounds", "speedup", "efficiency", "censored"])])})
        blocks.append({"panels": [{"type": "scatter", "title": f"final {t.metric} against {d.scale_key}",
                                   "x": f"config:{d.scale_key}", "y": f"summary:final/{t.metric}_mean",
                                   "log_x": True, "log_y": t.metric in LOSSES}]})
    return blocks


def _objective_metric(trials: pd.DataFrame) -> str | None:
    """The metric of a `final METRIC` objective (None for rounds-to-target objectives, or no trials)."""
    objective = str(trials["objective"].iloc[0]) if len(trials) else ""
    return objective.split()[1] if objective.startswith("final ") else None


def _tuning_blocks(trials: pd.DataFrame) -> list[dict]:
    """The tuning history: each trial's final objective metric against its number, and the trials table."""
    if not len(trials):
        return []
    cols = ["study", "trial", "status", "value", "objective", "params_json", "run_id"]
    blocks = [{"markdown": "## Tuning history\n\n" + markdown.table(trials, [c for c in cols if c in trials])}]
    metric = _objective_metric(trials)
    if metric is not None:
        blocks.append({"panels": [{"type": "scatter", "title": f"tuning history: final {metric} by trial",
                                   "x": "config:trial", "y": f"summary:final/{metric}_mean",
                                   "log_y": metric in LOSSES}]})
    return blocks


def logged_runs(results: Results) -> pd.DataFrame:
    """The flat configs (index run_id) of the runs logged to W&B; ConfigError when there is none: a Report's
    run set is a filter on their run_ids, and an empty filter would show every run of the project."""
    cfg = pd.DataFrame(list(results.runs["cfg"]), index=results.runs["run_id"])
    logged = cfg[cfg.get("wandb.enabled", pd.Series(False, index=cfg.index)).fillna(False).astype(bool)]
    require(len(logged) > 0, "--wandb-report", str(results.root), f"none of its {len(cfg)} run{'s' * (len(cfg) != 1)} was logged to W&B, "
            "so a W&B Report would show no run of the study; run them with wandb.enabled=true")
    return logged


def build_spec(report: Report, results: Results, project: str | None, entity: str | None) -> dict:
    """The report of `results` as plain JSON: title, description, the W&B runs it shows and its blocks."""
    logged = logged_runs(results)
    runs, d = report.tables["runs"], report.design
    studies = sorted(runs["study"].dropna().unique())
    trials = _trials(results.store, studies)
    kind = "Tuning study" if len(trials) else "Study"
    # a sweep's runs differ in n (the scale key); a study's trials differ in the tuned keys, one run per trial
    groupby = "trial" if len(trials) else d.scale_key
    design = (f"one run per trial, tuned: {', '.join(d.group_keys) or 'nothing'}" if len(trials) else
              f"n = {d.scale_key}; groups by {', '.join(d.group_keys) or 'nothing'}")
    counts = runs["status"].value_counts().to_dict()
    description = (f"{len(runs)} runs of {', '.join(studies)} ({', '.join(f'{v} {k}' for k, v in counts.items())}); "
                   f"{design}; targets: {', '.join(t.label for t in report.targets) or 'none'}. "
                   f"From fedharness report {results.root}.")
    metrics = [t.metric for t in report.targets] or [_objective_metric(trials) or "train_loss"]
    run_note = f"{len(logged)} of {len(runs)} runs were logged to W&B; offline ones appear after `wandb sync`."
    blocks: list[dict] = [
        {"markdown": f"{description}\n\n{run_note}\n\n## Groups\n\n{markdown.table(report.tables['groups'])}"},
        {"panels": [_line(m, groupby) for m in dict.fromkeys(metrics)]},
        *_target_blocks(report), *_tuning_blocks(trials),
        {"markdown": "## Runs\n\n" + markdown.table(runs.drop(columns=["error"], errors="ignore"))},
    ]
    spec = {
        "format": SPEC_FORMAT, "title": f"{kind}: {', '.join(studies)}"[:128], "description": description,
        "project": project or _one(logged.get("wandb.project"), None) or load_config([])["wandb"]["project"],
        "entity": entity or _one(logged.get("wandb.entity"), None),
        "runs": {"name": ", ".join(studies), "run_ids": sorted(logged.index)},
        "blocks": blocks,
    }
    return mask_secrets(json.loads(json.dumps(spec, default=_plain)))


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _metric(text: str):
    """`config:KEY` / `summary:KEY` (a scatter axis) as wandb-workspaces' metric objects."""
    import wandb_workspaces.reports.v2 as wr

    section, _, key = text.partition(":")
    return {"config": wr.Config, "summary": wr.SummaryMetric}[section](key)


def _panel(p: dict):
    import wandb_workspaces.reports.v2 as wr

    if p["type"] == "line":
        return wr.LinePlot(title=p["title"], x=p["x"], y=p["y"], groupby=wr.Config(p["groupby"]), log_y=p["log_y"])
    return wr.ScatterPlot(title=p["title"], x=_metric(p["x"]), y=_metric(p["y"]), log_x=p.get("log_x"),
                          log_y=p.get("log_y"))


def to_report(spec: dict, entity: str):
    """The spec as a `wandb_workspaces` Report (building it looks the project up on the W&B server)."""
    wr = require_extra("wandb_workspaces.reports.v2", "--wandb-report", "publish")

    ids = spec["runs"]["run_ids"]
    require(len(ids) > 0, "--publish", spec["title"], "a spec with W&B runs: an empty run set would show every "
            "run of the project")
    runset = wr.Runset(entity=entity, project=spec["project"], name=spec["runs"]["name"],
                       filters="Config('run_id') in [" + ", ".join(f"'{i}'" for i in ids) + "]")
    blocks = [wr.MarkdownBlock(text=b["markdown"]) if "markdown" in b else
              wr.PanelGrid(runsets=[runset], panels=[_panel(p) for p in b["panels"]]) for b in spec["blocks"]]
    return wr.Report(project=spec["project"], entity=entity, title=spec["title"], description=spec["description"],
                     blocks=blocks)


def publish(spec: dict) -> str:
    """Save the report to W&B; returns its URL."""
    wandb = require_extra("wandb", "--wandb-report", "publish")

    entity = spec["entity"] or wandb.Api().default_entity
    return to_report(spec, entity).save().url


def spec_path(args: argparse.Namespace) -> Path:
    return Path(args.out) if args.out else report_dir(open_store(args.results_dir))


def write(report: Report, results: Results, args: argparse.Namespace) -> None:
    """`--wandb-report`: write the spec of the report of `results`; publish it now when W&B is online, else print
    the command that will."""
    spec = build_spec(report, results, args.wandb_project, args.wandb_entity)
    path = report.out_dir / SPEC_NAME
    atomic_text(path, json.dumps(spec, indent=1) + "\n")
    log.info(f"wandb report: {shown(path)} ({sum(len(b.get('panels', [])) for b in spec['blocks'])} panels, "
             f"{len(spec['runs']['run_ids'])} W&B runs)")
    if resolve_mode(args.wandb_mode or "auto") == "online":
        log.info(f"wandb report: published {publish(spec)}")
    else:
        out = f" --out {shown(report.out_dir)}" if args.out else ""
        log.info(f"wandb report: offline; publish it later with: fedharness report {shown(args.results_dir)}{out} "
                 "--publish")


def publish_file(args: argparse.Namespace) -> int:
    """`--publish`: save the spec written by an earlier `--wandb-report` to W&B (nothing is recomputed)."""
    path = spec_path(args) / SPEC_NAME
    require(path.is_file(), "--publish", str(path), "a spec written by fedharness report DIR --wandb-report")
    spec = json.loads(path.read_text())
    require(spec.get("format") == SPEC_FORMAT, "--publish", str(path), f"a {SPEC_FORMAT} spec")
    log.info(f"wandb report: published {publish(spec)}")
    return 0
