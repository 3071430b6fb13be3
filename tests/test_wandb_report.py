"""`fedharness report DIR --wandb-report`: the spec written offline, then published from that file alone to a
W&B server that is a small HTTP server on 127.0.0.1 recording what the client sends."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fedharness import cli
from fedharness.runs.execute import execute

ENTITY, PROJECT = "fh-entity", "fh-demo"
PROJECT_NODE = {"__typename": "Project", "id": "UHJvamVjdDox", "name": PROJECT, "entityName": ENTITY,
                "createdAt": "2026-01-01T00:00:00", "isBenchmark": False, "user": None}
ANSWERS = {  # the GraphQL operations wandb-workspaces' Report.save() makes, answered minimally
    "Viewer": {"viewer": {"id": "VXNlcjox", "entity": ENTITY, "username": "fh", "email": "fh@example.org",
                          "admin": False, "flags": "{}", "teams": {"edges": []}}},
    "GetDefaultEntity": {"viewer": {"id": "VXNlcjox", "entity": ENTITY}},
    "ProjectInternalId": {"project": {"id": "UHJvamVjdDox", "internalId": "proj-1"}},
    "GetProjects": {"models": {"pageInfo": {"__typename": "PageInfo", "endCursor": None, "hasNextPage": False},
                               "edges": [{"node": PROJECT_NODE}]}},
}


class FakeWandb(BaseHTTPRequestHandler):
    calls: list[tuple[str, dict]] = []  # (GraphQL operation, variables)

    def log_message(self, *args) -> None:
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/graphql":  # wandb-core's own telemetry (protobuf): accepted, ignored
            return self._reply({})
        body = json.loads(raw)
        op = re.search(r"(?:query|mutation)\s+(\w+)", body["query"]).group(1)
        variables = body.get("variables") or {}
        self.calls.append((op, variables))
        if op == "upsertView":
            view = {"id": "VmlldzoxMjM=", "type": variables["type"], "name": variables["name"],
                    "displayName": variables["displayName"], "description": variables["description"],
                    "spec": json.loads(variables["spec"]), "updatedAt": "2026-01-01T00:00:00",
                    "project": {"id": "UHJvamVjdDox", "name": PROJECT, "entityName": ENTITY}}
            return self._reply({"data": {"upsertView": {"inserted": True, "view": view}}})
        return self._reply({"data": ANSWERS[op]})


@pytest.fixture
def fake_wandb(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeWandb)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeWandb.calls = []
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    yield FakeWandb.calls
    server.shutdown()


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 9 s idle
def test_report_spec_offline_then_published_from_the_file(run_config, tmp_path, monkeypatch, capsys, fake_wandb):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the study's runs and the report: offline, as here by default
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_ids = sorted(execute(run_config("dataset=quadratic", "rounds=10", "eval_every=2", "replicas=2", "study=wr",
                                        f"algorithm.clients_per_round={n}", "wandb.enabled=true",
                                        f"wandb.project={PROJECT}")).run_id for n in (1, 2, 4))
    results = tmp_path / "results"
    args = ["report", str(results), "--target", "subopt<=0.5", "--bootstrap", "20", "--wandb-report"]
    assert cli.main(args) == 0
    out = capsys.readouterr()
    assert f"fedharness report {results} --publish" in out.err and fake_wandb == []  # nothing sent yet
    spec = json.loads((results / "report" / "wandb_report.json").read_text())
    assert spec["runs"]["run_ids"] == run_ids and spec["project"] == PROJECT

    assert cli.main(["report", str(results), "--publish"]) == 0
    assert "fedharness: wandb report: published http://127.0.0.1:" in capsys.readouterr().err
    (variables,) = [v for op, v in fake_wandb if op == "upsertView"]
    assert (variables["entityName"], variables["projectName"]) == (ENTITY, PROJECT)
    assert variables["displayName"] == "Study: wr" and "3 runs of wr" in variables["description"]
    blocks = json.loads(variables["spec"])["blocks"]
    grids = [b["metadata"] for b in blocks if b["type"] == "panel-grid"]
    panels = [p["config"] for g in grids for p in g["panelBankSectionConfig"]["panels"]]
    line = next(p for p in panels if p.get("metrics") == ["subopt"])
    assert line["xAxis"] == "round" and line["groupBy"] == "algorithm.value.clients_per_round"
    assert any("final/subopt_mean" in json.dumps(p) for p in panels)  # final subopt against n
    for grid in grids:  # every panel grid shows exactly the study's W&B runs
        (runset,) = grid["runSets"]
        assert runset["project"]["name"] == PROJECT
        assert runset["filters"]["filters"] == [{"key": {"section": "config", "name": "run_id"}, "op": "IN",
                                                 "value": run_ids, "disabled": False}]
    text = json.dumps(blocks)
    assert "Target `subopt<=0.5`: speedup and its fit" in text and all(i in text for i in run_ids)  # the tables


def test_project_and_entity_flags_name_the_report_s_home(run_config, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    execute(run_config("dataset=quadratic", "rounds=4", "eval_every=2", "study=wr", "wandb.enabled=true"))
    results = tmp_path / "results"
    assert cli.main(["report", str(results), "--target", "subopt<=0.5", "--bootstrap", "20", "--wandb-report",
                     "--project", "elsewhere", "--entity", "team"]) == 0
    spec = json.loads((results / "report" / "wandb_report.json").read_text())
    assert (spec["project"], spec["entity"]) == ("elsewhere", "team")


@pytest.mark.slow  # CI only (issue 35: the default run in under 5 minutes); 5 s idle
def test_a_tuning_study_s_lines_are_grouped_by_trial(tmp_path, monkeypatch, capsys):
    """Its runs share clients_per_round (the sweeps' scale key) and differ by trial: one line per trial."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    results = tmp_path / "results"
    assert cli.main(["tune", "tune=quadratic_lr", "tune.n_trials=3", "tune.budget.total=10", "tune.plots=false",
                     "tune.study=tw", f"results_dir={results}", "wandb.enabled=true"]) == 0
    assert cli.main(["report", str(results), "--wandb-report"]) == 0
    spec = json.loads((results / "report" / "wandb_report.json").read_text())
    lines = [p for b in spec["blocks"] for p in b.get("panels", []) if p["type"] == "line"]
    assert [(p["y"], p["groupby"]) for p in lines] == [(["dist_to_opt"], "trial")]
    assert spec["title"] == "Tuning study: tw" and "one run per trial, tuned: algorithm.client_lr" in spec["description"]
    # and so is the panel wandb-workspaces builds from the spec (building a panel needs no network)
    import wandb_workspaces.reports.v2 as wr

    from fedharness.studies.reports.wandb_report import _panel

    assert _panel(lines[0]).groupby == wr.Config("trial")


def test_a_report_of_a_study_never_logged_to_wandb_is_refused_in_one_line(run_config, tmp_path, capsys):
    """No W&B run means an empty run-set filter, which W&B reads as every run of the project: refused before
    any report file is written; a spec without runs is not published either."""
    for n in (1, 2):
        execute(run_config("dataset=quadratic", "rounds=4", "eval_every=2", "study=nw",
                           f"algorithm.clients_per_round={n}"))
    results = tmp_path / "results"
    capsys.readouterr()
    assert cli.main(["report", str(results), "--target", "subopt<=0.5", "--wandb-report"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith(f"fedharness: error: invalid value for '--wandb-report': '{results}' (none of its "
                              "2 runs was logged to W&B")
    assert not (results / "report").exists()

    from fedharness.errors import ConfigError
    from fedharness.studies.reports.wandb_report import to_report

    spec = {"title": "Study: nw", "description": "", "project": PROJECT, "runs": {"name": "nw", "run_ids": []},
            "blocks": []}
    with pytest.raises(ConfigError, match="empty run set would show every run"):
        to_report(spec, ENTITY)
