"""The run-report plugin: its pages in a real headless Chromium, and its registration with Airflow.

Reports are produced by the real evaluate task on fixture training outputs (see tests/tasks/run_fixtures.py), so
the pages render exactly what the pipeline writes.
"""

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from html import unescape
from pathlib import Path
from urllib.parse import urlencode, urlsplit

import pytest
import uvicorn
from fastapi.testclient import TestClient
from tf_multiworker.backends import make_backend

from core.layout import run_key
from core.storage import join, upload_tree, write_json_atomic
from tasks import evaluate
from tasks.report.document import Comparison
from tests.support.browser import chromium
from tests.tasks import run_fixtures

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
KEY_28 = run_key(run_fixtures.DAG_ID, "scheduled__2026-11-28T02:00:00+00:00")
KEY_29 = run_key(run_fixtures.DAG_ID, "scheduled__2026-11-29T02:00:00+00:00")

sys.path.insert(0, str(REPO / "plugins"))  # as Airflow does for its plugins folder
from gpt_finetune_ui.report_pages import render_run
from gpt_finetune_ui.reports_app import create_app


@pytest.fixture(scope="module")
def storage_root(tmp_path_factory):
    """Two finished runs (2 and 4 workers, one failing its gate) and one still training."""
    root = str(tmp_path_factory.mktemp("ui") / "storage")
    calls = Path(root).parent / "evaluate-calls.txt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluate, "EVALUATE_MODULE", "tests.tasks.fixture_evaluate")
        patch.setenv("TFMW_FIXTURE_EVALUATE_CALLS", str(calls))
        patch.setenv("PYTHONPATH", str(REPO))
        for run_id, workers, train_time_s, tolerance, gates in (
                ("scheduled__2026-11-28T02:00:00+00:00", 2, 30.0, 0.02, "passed"),
                ("scheduled__2026-11-29T02:00:00+00:00", 4, 22.0, 0.001, "failed")):
            prepared = run_fixtures.prepare_run(root, run_id, num_workers=workers, batch_size_per_worker=16 // workers,
                                                loss_tolerance=tolerance)
            run_fixtures.write_training_output(prepared.baseline_url, num_workers=1, train_time_s=33.0,
                                               eval_loss=5.30)
            run_fixtures.write_training_output(prepared.train_url, num_workers=workers,
                                               train_time_s=train_time_s, eval_loss=5.31)
            if gates == "passed":
                evaluate.evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)
                continue
            # The second run fails its parity gate on purpose (the page must show it), and only that gate.
            with pytest.raises(evaluate.GateFailure,
                               match=r"^1 comparison gate\(s\) failed .*eval loss distributed "
                                     r"5\.3100 - baseline 5\.3000 = \+0\.0100 nats, tolerance ±0\.0010"):
                evaluate.evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)
    write_json_atomic(join(root, "runs", "manual__training", "config.json"), {})
    # The older run was released; the newer one's release has not run yet.
    write_json_atomic(join(root, "runs", KEY_28, "report", "release.json"), {"clean": True})
    Path(root, "runs", "manual__training", "report", "release.json").mkdir(parents=True)  # unreadable: not released
    return root


@pytest.fixture(scope="module")
def server_url(storage_root):
    """The plugin's FastAPI app served by uvicorn on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(storage_root), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


def test_pages_list_runs_and_show_a_report_with_its_charts(server_url, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 900})

    page.goto(f"{server_url}/")
    rows = page.locator("#runs tr")
    assert rows.count() == 4  # header, two reports, the run still training
    newest = rows.nth(1).inner_text()
    assert newest.split("\t")[:6] == ["scheduled__2026-11-29T02:00:00+00:00", "failed", "pending", "4", "1.50x",
                                      "38%"]
    assert rows.nth(2).inner_text().split("\t")[:6] == ["scheduled__2026-11-28T02:00:00+00:00", "passed", "yes",
                                                        "2", "1.10x", "55%"]
    assert "no report yet" in rows.nth(3).inner_text()
    page.screenshot(path=str(ARTIFACTS / "ui_runs.png"), full_page=True)

    page.get_by_role("link", name="scheduled__2026-11-29T02:00:00+00:00").click()
    page.wait_for_load_state("load")
    assert page.url == f"{server_url}/runs/{KEY_29}/"
    figures = [row.split("\t") for row in page.locator("#figures tr").all_inner_texts()]
    assert figures[0] == ["run", "workers", "train time", "eval time", "tokens/s", "speedup", "efficiency",
                          "eval loss", "perplexity", "nats/char", "known words"]
    assert figures[2][:7] == ["distributed", "4", "22.0 s", "1.2 s", "1,815", "1.50x", "38%"]
    assert page.locator("#released").inner_text() == "pending"
    assert "4 workers on a 2-core CPU: efficiency is bounded by cores" in page.locator("#hardware").inner_text()
    assert "+0.0100 nats, tolerance ±0.0010" in page.locator("#gates").inner_text()
    widths = page.eval_on_selector_all("img", "images => images.map(i => i.complete ? i.naturalWidth : 0)")
    assert widths == [825, 1100]  # both charts fetched from storage and decoded by the browser
    page.screenshot(path=str(ARTIFACTS / "ui_run_report.png"), full_page=True)

    page.get_by_role("link", name="All runs").click()
    assert page.locator("#runs tr").count() == 4


def test_unknown_runs_and_files_are_refused(server_url, browser):
    page = browser.new_page()
    assert page.goto(f"{server_url}/runs/manual__training/").status == 404
    assert page.goto(f"{server_url}/runs/{KEY_28}/charts/report.json").status == 404
    assert page.goto(f"{server_url}/runs/..%2F..%2Fdatasets/").status == 404
    api = page.goto(f"{server_url}/api/runs")
    assert [run["status"] for run in api.json()] == ["failed", "passed", "no report yet"]
    assert [run["released"] for run in api.json()] == ["pending", "yes", "no"]


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: str


def urllib_get(url: str) -> RawResponse:
    """GET exactly this path (no client-side normalisation of dot segments or escapes)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", parts.path)
        response = connection.getresponse()
        headers = {name.lower(): value for name, value in response.getheaders()}
        return RawResponse(response.status, headers, response.read().decode(errors="replace"))
    finally:
        connection.close()


SCRIPT = "<script>alert(document.cookie)</script>"


def _poisoned(value):
    """Every string with a script in it, every number a string (a wrong type); the structure kept."""
    if isinstance(value, dict):
        return {key: _poisoned(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_poisoned(item) for item in value]
    if isinstance(value, str):
        return SCRIPT + value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{SCRIPT}{value}"
    return value


@pytest.fixture
def hostile_storage(storage_root, tmp_path):
    """A real report rewritten by someone who can write to storage, plus malformed ones."""
    root = tmp_path / "storage"
    good = KEY_28
    report = json.loads((Path(storage_root) / "runs" / good / "report" / "report.json").read_text())
    write_json_atomic(str(root / "runs" / "poisoned" / "report" / "report.json"), _poisoned(report))
    write_json_atomic(str(root / "runs" / "empty" / "report" / "report.json"), {})
    write_json_atomic(str(root / "runs" / "a_list" / "report" / "report.json"), [SCRIPT])
    (root / "runs" / "not_json" / "report").mkdir(parents=True)
    (root / "runs" / "not_json" / "report" / "report.json").write_text("{" + SCRIPT)
    shutil.copytree(Path(storage_root) / "runs" / good, root / "runs" / good)
    return root


def test_hostile_reports_render_escaped_as_error_rows(hostile_storage):
    client = TestClient(create_app(str(hostile_storage)))

    index = client.get("/")
    assert index.status_code == 200
    assert "<script" not in index.text.lower()
    statuses = {run["run_key"]: run["status"] for run in client.get("/api/runs").json()}
    assert statuses == {  # the field and what is wrong with it, never the value a storage writer put there
        KEY_28: "passed",
        "poisoned": "unreadable report: format_version: expected int, got str",
        "empty": "unreadable report: the report: missing key(s) format_version, run_id, run_key, created_at, "
                 "num_workers, gates_passed, runs, comparison, gates: not a complete RunReport",
        "a_list": "unreadable report: the report: expected a JSON object, got list: not a RunReport",
        "not_json": "unreadable report: not valid JSON",
    }

    page = client.get("/runs/poisoned/")  # the page says what the index says (tasks/report/document.py checks)
    assert page.status_code == 422 and "format_version: expected int, got str" in page.text
    for key in ("poisoned", "empty", "a_list", "not_json"):
        response = client.get(f"/runs/{key}/")
        assert response.status_code == 422 and "<script" not in response.text.lower(), key
    poisoned = {**_poisoned(client.get(f"/api/runs/{KEY_28}").json()), "format_version": 1, "num_workers": 2}
    write_json_atomic(str(hostile_storage / "runs" / "poisoned" / "report" / "report.json"), poisoned)
    assert client.get("/runs/poisoned/").status_code == 422  # every figure is a string: refused by the first


def test_an_elastic_runs_page_shows_its_segments_and_the_predicted_scaling(storage_root, tmp_path):
    """The segments and the advisor's prediction that report.md has (tasks/report/scaling.py), on the run's page too,
    with what a worker may have influenced (the reason a launch gives) escaped."""
    from tasks.report import scaling

    root = tmp_path / "storage"
    shutil.copytree(Path(storage_root) / "runs" / KEY_28, root / "runs" / KEY_28)
    report_file = root / "runs" / KEY_28 / "report" / "report.json"
    report = json.loads(report_file.read_text())
    launches = run_fixtures.ELASTIC_RECORD["launches"]
    record = {**run_fixtures.ELASTIC_RECORD, "launches": [*launches[:2], {**launches[2], "reason": SCRIPT}]}
    advice = {"rows": [{"num_workers": 2, "speedup": 1.6, "efficiency": 0.8, "tokens_per_s": 1600.0}],
              "recommendation": "2 workers: predicted 80% efficiency (1.60x)", "inputs": {"step_source": "probe"}}
    comparison = Comparison(speedup=1.5, efficiency=0.75, loss_delta=None, loss_tolerance=0.02)
    metrics = run_fixtures.step_metrics(range(1, 41), 0.1)
    report.update(segments=[row.to_json() for row in scaling.segments(record, metrics, final_step=40)], elastic=True,
                  num_workers=4, prediction=scaling.prediction({"advisor": advice}, 2, comparison).to_json())
    report_file.write_text(json.dumps(report))

    page = TestClient(create_app(str(root))).get(f"/runs/{KEY_28}/").text
    segments = page.split("<table id='segments'>")[1].split("</table>")[0]
    assert "<tr><td>1-20</td><td>4 of 4</td><td>1</td><td>5,120</td>" in segments
    assert "<tr><td>21-40</td><td>2 of 4</td><td>2</td><td>5,120</td>" in segments
    assert "continued on 2 of 4 workers from step 20: &lt;script&gt;" in segments and "<script" not in page
    prediction = page.split("<table id='prediction'>")[1].split("</table>")[0]
    assert "<tr><td>2</td><td>1.60x</td><td>1.50x</td><td>80%</td><td>75%</td></tr>" in prediction
    assert "Advisor (single-worker step from the probe): 2 workers: predicted 80% efficiency (1.60x)" in page
    report.pop("segments"), report.pop("prediction")
    report_file.write_text(json.dumps({**report, "elastic": False}))
    plain = TestClient(create_app(str(root))).get(f"/runs/{KEY_28}/").text
    assert "id='segments'" not in plain and "id='prediction'" not in plain


def test_report_md_and_the_run_page_write_the_same_view(storage_root):
    """One view (tasks/report/view.py), two writers: every section title, table column and cell, line of text,
    warning and chart of a report with every section appears in report.md and on the run's page."""
    from tasks.report import blocks, scaling
    from tasks.report import view as report_view
    from tasks.report.document import RunReport
    from tasks.report.parts import run_view
    from tasks.report.store import render_markdown

    report = json.loads((Path(storage_root) / "runs" / KEY_28 / "report" / "report.json").read_text())
    advice = {"rows": [{"num_workers": 2, "speedup": 1.6, "efficiency": 0.8, "tokens_per_s": 1600.0}],
              "recommendation": "2 workers: predicted 80% efficiency (1.60x)", "inputs": {"step_source": "probe"}}
    segments = scaling.segments(run_fixtures.ELASTIC_RECORD, run_fixtures.step_metrics(range(1, 41), 0.1), 40)
    comparison = Comparison.from_json(report["comparison"], "report.json", "comparison")
    report.update(
        segments=[row.to_json() for row in segments], elastic=True, num_workers=4,
        prediction=scaling.prediction({"advisor": advice}, 2, comparison).to_json(),
        warnings=["4,000 tokens/s is 40% of the 10,000 predicted"],
        continued_from={"name": "gpt_finetune", "version": "v1", "run_id": "nightly__1", "eval_loss": 5.3})
    shown_report = run_view(RunReport.from_json(report, "report.json"),
                            {"promoted": False, "policy": "auto", "reason": "worse than the promoted version"}, None)
    view = report_view.report_view(shown_report)
    markdown, page = render_markdown(shown_report), unescape(render_run(shown_report))

    titles = [section.title for section in view.sections if section.title]
    assert titles == ["Gates", "Segments (elastic recovery)", "Scaling: predicted (preflight advisor) vs measured",
                      "Promotion", "Samples", "Charts", "Versions"]
    assert all(f"## {title}" in markdown and f"<h2>{title}</h2>" in page for title in titles)
    shown = []  # every text of the view, whichever block holds it
    for block in (block for section in view.sections for block in section.blocks):
        if isinstance(block, blocks.Table):
            shown += [*block.columns, *(cell for row in block.rows for cell in row)]
        elif isinstance(block, blocks.Bullets | blocks.Paragraph):
            items = block.items if isinstance(block, blocks.Bullets) else [block]
            shown += [mark for item in items for mark in item.line]
        elif isinstance(block, blocks.Warnings):
            shown += block.texts
        elif isinstance(block, blocks.Charts):
            shown += [file for _, file in block.files]
    texts = [mark if isinstance(mark, str) else mark.text for mark in shown]
    assert len(texts) > 80 and "Not promoted" in texts and "5,120" in texts
    assert [text for text in texts if " ".join(text.split()) not in markdown] == []
    assert [text for text in texts if text not in page] == []


def test_a_runs_throughput_warnings_show_above_its_figures_escaped(storage_root, tmp_path):
    root = tmp_path / "storage"
    shutil.copytree(Path(storage_root) / "runs" / KEY_28, root / "runs" / KEY_28)
    report_file = root / "runs" / KEY_28 / "report" / "report.json"
    report = json.loads(report_file.read_text())
    report_file.write_text(json.dumps({**report, "warnings": ["4,000 tokens/s is 40% of the 10,000 predicted",
                                                              SCRIPT]}))
    page = TestClient(create_app(str(root))).get(f"/runs/{KEY_28}/").text
    warnings = page.split("<ul id='warnings' class='warning'>")[1].split("</ul>")[0]
    assert warnings.startswith("<li>4,000 tokens/s is 40% of the 10,000 predicted</li><li>&lt;script&gt;")
    assert warnings.count("<li>") == 2 and page.index("id='warnings'") < page.index("id='figures'")
    report_file.write_text(json.dumps({**report, "warnings": ["slow", {"not": "text"}]}))  # not what evaluate writes
    refused = TestClient(create_app(str(root))).get(f"/runs/{KEY_28}/")
    assert refused.status_code == 422 and "warnings[1]: expected str, got dict" in refused.text
    report_file.write_text(json.dumps(report))  # a report from before warnings existed
    assert "id='warnings'" not in TestClient(create_app(str(root))).get(f"/runs/{KEY_28}/").text


def test_pages_show_the_latest_model_its_history_and_each_runs_samples(tmp_path, monkeypatch):
    """Two nightly runs promoted in turn, then one that is not: the index names the run behind `latest` and every
    version; a run page shows why it was (not) promoted and its samples beside the promoted version's."""
    from tasks.promote import promote_run

    root = str(tmp_path / "storage")
    monkeypatch.setattr(evaluate, "EVALUATE_MODULE", "tests.tasks.fixture_evaluate")
    monkeypatch.setenv("TFMW_FIXTURE_EVALUATE_CALLS", str(tmp_path / "calls.txt"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    keys = {}
    for run_id, eval_loss in (("nightly__1", 5.30), ("nightly__2", 5.20), ("nightly__3", 5.90)):
        prepared = run_fixtures.prepare_run(root, run_id, baseline="skip")
        run_fixtures.write_training_output(prepared.train_url, num_workers=2, train_time_s=30.0,
                                           eval_loss=eval_loss)
        evaluate.evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)
        promote_run(prepared, run_fixtures.own_run(prepared))
        keys[run_id] = prepared.run_key
    client = TestClient(create_app(root))

    index = client.get("/").text
    assert ("gpt_finetune: latest is <b>v2</b>, produced by run "
            f"<a href='runs/{keys['nightly__2']}/'>nightly__2</a>") in index
    history = index.split("id='history-gpt_finetune'>")[1].split("</table>")[0]
    assert [row.split("</td>")[0] for row in history.split("<tr><td>")[1:]] == ["v2", "v1"]
    assert "<td>5.2000</td>" in history and f"<a href='runs/{keys['nightly__1']}/'>nightly__1</a>" in history
    (model,) = client.get("/api/models").json()
    assert (model["latest"], model["run_id"], len(model["history"])) == ("v2", "nightly__2", 2)

    page = client.get(f"/runs/{keys['nightly__3']}/").text
    # The verdict in report.md's words (one view writes both), coloured on the page.
    assert "<span class='fail'>Not promoted</span> (policy 'auto'): worse than the promoted version" in unescape(page)
    samples = page.split("<h2>Samples</h2>")[1]
    assert "<b>Prompt 1:</b> To be, or not" in samples
    assert "<tr><td>distributed</td>" in samples and "<tr><td>promoted v2</td>" in samples
    assert "the question of a fixture" in samples
    quality = samples.split("id='sample-quality'>")[1].split("</table>")[0]
    assert "<tr><td>promoted v2</td><td>5.2000</td><td>1.733</td><td>100% / 75%</td></tr>" in quality
    assert "<td>100% / 75%</td>" in index  # the runs page: the distributed model's known-word rates
    assert "<span class='pass'>Promoted</span> to gpt_finetune v2" in client.get(f"/runs/{keys['nightly__2']}/").text


def test_responses_forbid_scripts_and_sniffing(server_url):
    for path in ("/", "/api/runs", f"/runs/{KEY_28}/", "/runs/nope/",
                 f"/runs/{KEY_28}/charts/scaling.png"):
        response = urllib_get(f"{server_url}{path}")
        csp = response.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src" not in csp, path
        assert response.headers["x-content-type-options"] == "nosniff", path


def test_run_keys_are_matched_whole_and_errors_name_no_storage_url(hostile_storage):
    """Reports placed where `.`, `..` or a key with a trailing newline would lead are never served."""
    report = hostile_storage / "runs" / KEY_28 / "report"
    for reachable in (hostile_storage / "report", hostile_storage / "runs" / "report",
                      hostile_storage / "runs" / f"{KEY_28}\n" / "report"):
        shutil.copytree(report, reachable)
    client = TestClient(create_app(str(hostile_storage)))
    assert client.get(f"/api/runs/{KEY_28}").status_code == 200
    for key in ("%2E", "%2E%2E", ".hidden", f"{KEY_28}%0A", "a%2Fb"):
        for path in (f"/api/runs/{key}", f"/runs/{key}/", f"/runs/{key}/charts/scaling.png"):
            assert client.get(path).status_code == 404, path

    for path in ("/runs/unknown/", f"/runs/{KEY_28}/charts/other.png", "/runs/not_json/"):
        response = client.get(path)
        assert response.status_code in (404, 422), path
        assert str(hostile_storage) not in response.text and "report.json" not in response.text, path


def test_the_access_dependency_guards_every_route_without_airflow(storage_root):
    """The app alone, given an access check as the plugin gives it Airflow's: 401 -> login redirect on pages."""
    from fastapi import HTTPException, Request

    def access(request: Request) -> None:
        token = request.headers.get("authorization")
        if token is None:
            raise HTTPException(401, "Not authenticated")
        if token != "Bearer reader":
            raise HTTPException(403, "Forbidden")

    client = TestClient(create_app(storage_root, access=access, login_url="/api/v2/auth/login"),
                        follow_redirects=False)
    for path in ("/api/runs", f"/api/runs/{KEY_28}"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer other"}).status_code == 403
        assert client.get(path, headers={"Authorization": "Bearer reader"}).status_code == 200
    for path in ("/", f"/runs/{KEY_28}/", f"/runs/{KEY_28}/charts/scaling.png"):
        response = client.get(path)
        assert response.status_code == 303
        assert response.headers["location"] == "/api/v2/auth/login?" + urlencode({"next": f"http://testserver{path}"})
        assert client.get(path, headers={"Authorization": "Bearer other"}).status_code == 403
        assert client.get(path, headers={"Authorization": "Bearer reader"}).status_code == 200


def test_airflow_loads_the_plugin_and_mounts_its_app(storage_root, tmp_path):
    """In a fresh interpreter, as the API server does: plugins folder scan, then `init_plugins` mounts the app."""
    script = """
import json
import sys
from fastapi import FastAPI
from fastapi.testclient import TestClient
from airflow import plugins_manager
from airflow.api_fastapi.app import init_plugins

app = FastAPI()
init_plugins(app)
info = [p for p in plugins_manager.get_plugin_info() if p["name"] == "gpt_finetune_reports"]
runs = TestClient(app).get("/gpt-finetune/api/runs")
errors = plugins_manager.get_import_errors()
shadowed = sorted(name for name in sys.stdlib_module_names if getattr(sys.modules.get(name), "__file__", "")
                  and "/plugins/" in sys.modules[name].__file__)
print(json.dumps({"info": info, "runs": runs.status_code, "errors": errors, "shadowed": shadowed},
                 default=str))
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW")}
    env.update({"AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "GPT_FINETUNE_STORAGE_ROOT": storage_root})
    result = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])

    # Every file Airflow scans becomes a top-level module named after it: none may fail or shadow the stdlib.
    assert loaded["errors"] == {} and loaded["shadowed"] == []
    (plugin,) = loaded["info"]
    assert plugin["source"] == "$PLUGINS_FOLDER/gpt_finetune_ui/ui_plugin.py"
    assert [(app["url_prefix"], app["name"]) for app in plugin["fastapi_apps"]] == [
        ("/gpt-finetune", "GPT fine-tune reports")]
    assert plugin["external_views"] == [{"name": "GPT fine-tune runs", "href": "gpt-finetune/",
                                         "url_route": "gpt-finetune-runs", "destination": "nav",
                                         "category": "browse"}]
    assert loaded["runs"] == 401  # mounted behind Airflow's login


def test_reports_are_read_from_s3(storage_root, s3_server, monkeypatch):
    for name, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_ACCESS_KEY_ID": "test-key",
                        "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    for report in sorted(Path(storage_root).glob("runs/*/report")):
        upload_tree(report, f"s3://runs/ui/runs/{report.parent.name}/report")
    client = TestClient(create_app("s3://runs/ui"))

    runs = client.get("/api/runs").json()
    assert [(run["status"], run["speedup"]) for run in runs] == [("failed", pytest.approx(1.5)),
                                                                ("passed", pytest.approx(1.1))]
    page = client.get(f"/runs/{KEY_28}/")
    assert page.status_code == 200 and "<td>1.10x</td>" in page.text
    chart = client.get(f"/runs/{KEY_28}/charts/scaling.png")
    assert chart.headers["content-type"] == "image/png" and chart.content.startswith(b"\x89PNG")


@pytest.fixture
def stack_run(airflow_stack, storage_root):
    """A finished run in the real Airflow's storage."""
    stack_storage = Path(airflow_stack.env["GPT_FINETUNE_STORAGE_ROOT"])
    shutil.copytree(Path(storage_root) / "runs" / KEY_28, stack_storage / "runs" / KEY_28, dirs_exist_ok=True)
    return KEY_28


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request, redirects not followed."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_the_reports_require_an_airflow_login(airflow_stack, stack_run):
    """In the real API server: 401/403 without valid credentials, 200 with a token of a user who may read the
    DAG's runs, and pages send a browser to Airflow's login page with the way back."""
    base = f"{airflow_stack.url}/gpt-finetune"
    for path in ("/api/runs", f"/api/runs/{stack_run}"):
        assert _get(base + path)[0] == 401, path
        assert _get(base + path, {"Authorization": "Bearer not-a-token"})[0] == 403, path
    for path in ("/", f"/runs/{stack_run}/", f"/runs/{stack_run}/charts/scaling.png"):
        status, headers, _ = _get(base + path)
        assert status == 303, path
        assert headers["location"] == "/api/v2/auth/login?" + urlencode({"next": base + path}), path

    user, password = airflow_stack.login
    request = urllib.request.Request(f"{airflow_stack.url}/auth/token", method="POST",
                                     data=json.dumps({"username": user, "password": password}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        token = json.load(response)["access_token"]
    status, _, body = _get(f"{base}/api/runs", {"Authorization": f"Bearer {token}"})
    assert status == 200 and stack_run in [run["run_key"] for run in json.loads(body)]
    status, headers, body = _get(f"{base}/runs/{stack_run}/", {"Cookie": f"_token={token}"})  # as the UI sends it
    assert status == 200 and b"<table id='figures'>" in body
    assert "default-src 'none'" in headers["content-security-policy"]


def test_a_logged_out_browser_lands_on_the_login_page_and_comes_back(airflow_stack, stack_run, browser):
    context = browser.new_context()
    page = context.new_page()
    target = f"{airflow_stack.url}/gpt-finetune/runs/{stack_run}/"
    page.goto(target)
    page.locator("input[name=username]").wait_for()
    assert "/auth/login" in page.url
    assert page.locator("#figures").count() == 0

    user, password = airflow_stack.login
    page.locator("input[name=username]").fill(user)
    page.locator("input[name=password]").fill(password)
    page.locator("button[type=submit]").click()
    page.wait_for_url(target)
    assert page.locator("#figures tr").nth(2).inner_text().split("\t")[:2] == ["distributed", "2"]
    context.close()


def test_the_nav_entry_shows_the_reports_inside_airflow(airflow_stack, stack_run, browser):
    """The real API server mounts the app; after logging in, the UI's navigation entry frames its pages."""
    user, password = airflow_stack.login
    page = browser.new_page(viewport={"width": 1400, "height": 1000})

    page.goto(f"{airflow_stack.url}/")
    page.locator("input[name=username]").fill(user)
    page.locator("input[name=password]").fill(password)
    page.locator("button[type=submit]").click()
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="GPT fine-tune runs").click()  # the navigation entry the plugin declared

    frame = page.frame_locator("iframe")
    frame.get_by_role("link", name="scheduled__2026-11-28T02:00:00+00:00").click()
    assert page.url.startswith(f"{airflow_stack.url}/plugin/gpt-finetune-runs")
    assert frame.locator("#figures tr").nth(2).inner_text().split("\t")[:6] == [
        "distributed", "2", "30.0 s", "1.2 s", "1,331", "1.10x"]
    page.screenshot(path=str(ARTIFACTS / "ui_in_airflow.png"))


# -- one crafted report.json never fails the index (issue 37 item 4, review finding 9) ---------------------------

@pytest.fixture
def crafted_storage(storage_root, tmp_path):
    """The good run, and reports a storage writer crafted: the review's reproductions and more."""
    root = tmp_path / "storage"
    shutil.copytree(Path(storage_root) / "runs" / KEY_28, root / "runs" / KEY_28)
    good = json.loads((root / "runs" / KEY_28 / "report" / "report.json").read_text())
    crafted = {
        "deep": "[" * 5000,  # RecursionError in list_runs: a 500 for everyone (the review's had 100000)
        "nested": "[" * 50 + "]" * 50,  # parses, nests past the limit
        "huge_int": json.dumps({**good, "runs": {**good["runs"], "distributed": {
            **good["runs"]["distributed"], "tokens_per_s": 10 ** 400}}}),  # OverflowError in render_index
        "not_utf8": b"\xff\xfe{}",
        "too_large": json.dumps({**good, "pad": "x" * 5000}),
    }
    for key, content in crafted.items():
        path = root / "runs" / key / "report" / "report.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    (root / "runs" / "deep" / "report" / "release.json").write_text("[" * 100000)
    return root


def test_a_crafted_report_is_an_error_row_and_never_a_500(crafted_storage, monkeypatch):
    from tasks.report import untrusted as report_file

    monkeypatch.setattr(report_file, "MAX_RECORD_BYTES", len(
        (crafted_storage / "runs" / KEY_28 / "report" / "report.json").read_bytes()) + 100)
    client = TestClient(create_app(str(crafted_storage)), raise_server_exceptions=False)
    assert client.get("/").status_code == 200
    statuses = {run["run_key"]: run["status"] for run in client.get("/api/runs").json()}
    assert statuses[KEY_28] == "passed"
    assert statuses["deep"] == "unreadable report: nested too deep"
    assert statuses["nested"] == "unreadable report: nested too deep: more than 32 levels"
    assert statuses["huge_int"] == "unreadable report: runs.distributed.tokens_per_s: expected float, got int"
    assert statuses["not_utf8"] == "unreadable report: not valid JSON"
    assert statuses["too_large"].startswith("unreadable report: too large: ")
    for key in ("deep", "nested", "not_utf8", "too_large"):
        assert client.get(f"/runs/{key}/").status_code == 422, key
    page = client.get("/runs/huge_int/")  # no figure: refused naming it, as on the index
    assert page.status_code == 422 and "runs.distributed.tokens_per_s: expected float, got int" in page.text


def test_the_run_page_is_linear_in_samples(storage_root, tmp_path):
    """The review measured 0.17 s, 0.67 s, 1.62 s for 1000, 2000, 4000 samples per model: quadratic."""
    import time

    from tasks.report.document import RunReport
    from tasks.report.parts import run_view

    report = json.loads((Path(storage_root) / "runs" / KEY_28 / "report" / "report.json").read_text())
    timings = {}
    for count in (4000, 40000):
        sample = {"prompt": "p", "greedy": "g", "top_k": "k"}
        report["samples"] = [{"model": name, "eval_loss": 5.0, "samples": [sample] * count}
                             for name in ("baseline", "distributed")]
        view = run_view(RunReport.from_json(report, "report.json"), None, {"clean": True})
        started = time.perf_counter()
        page = render_run(view)
        timings[count] = time.perf_counter() - started
        assert page.count("Prompt ") <= 50
    assert timings[40000] < 2.0, timings
