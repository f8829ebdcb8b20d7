"""The run-report plugin: its pages in a real headless Chromium, and its registration with Airflow.

Reports are produced by the real evaluate task on fixture training outputs (see tests/tasks/run_fixtures.py), so
the pages render exactly what the pipeline writes.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from tasks import compare
from tests.browser import chromium
from tests.tasks import run_fixtures
from trainer.storage import join, upload_tree, write_json_atomic

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"

sys.path.insert(0, str(REPO / "plugins"))  # as Airflow does for its plugins folder
from gpt_finetune_ui.reports_app import create_app


@pytest.fixture(scope="module")
def storage_root(tmp_path_factory):
    """Two finished runs (2 and 4 workers, one failing its gate) and one still training."""
    root = str(tmp_path_factory.mktemp("ui") / "storage")
    calls = Path(root).parent / "evaluate-calls.txt"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compare, "EVALUATE_MODULE", "tests.tasks.fixture_evaluate")
        patch.setenv("FIXTURE_EVALUATE_CALLS", str(calls))
        patch.setenv("PYTHONPATH", str(REPO))
        for run_id, workers, train_time_s, tolerance, gates in (
                ("scheduled__2026-11-28T02:00:00+00:00", 2, 30.0, 0.02, "passed"),
                ("scheduled__2026-11-29T02:00:00+00:00", 4, 22.0, 0.001, "failed")):
            prepared = run_fixtures.prepare_run(root, run_id, num_workers=workers, batch_size_per_worker=16 // workers,
                                                loss_tolerance=tolerance)
            run_fixtures.write_training_output(prepared["baseline_url"], num_workers=1, train_time_s=33.0,
                                               eval_loss=5.30)
            run_fixtures.write_training_output(prepared["train_url"], num_workers=workers,
                                               train_time_s=train_time_s, eval_loss=5.31)
            if gates == "passed":
                compare.evaluate_run(prepared)
                continue
            # The second run fails its parity gate on purpose (the page must show it), and only that gate.
            with pytest.raises(compare.GateFailure, match=r"^1 comparison gate\(s\) failed .*eval loss distributed "
                                                          r"5\.3100 - baseline 5\.3000 = \+0\.0100 nats, tolerance ±0\.0010"):
                compare.evaluate_run(prepared)
    write_json_atomic(join(root, "runs", "manual__training", "config.json"), {})
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
    assert newest.split("\t")[:5] == ["scheduled__2026-11-29T02:00:00+00:00", "failed", "4", "1.50x", "38%"]
    assert rows.nth(2).inner_text().split("\t")[:5] == ["scheduled__2026-11-28T02:00:00+00:00", "passed", "2",
                                                        "1.10x", "55%"]
    assert "no report yet" in rows.nth(3).inner_text()
    page.screenshot(path=str(ARTIFACTS / "ui_runs.png"), full_page=True)

    page.get_by_role("link", name="scheduled__2026-11-29T02:00:00+00:00").click()
    page.wait_for_load_state("load")
    assert page.url == f"{server_url}/runs/scheduled__2026-11-29T02_00_00_00_00/"
    figures = [row.split("\t") for row in page.locator("#figures tr").all_inner_texts()]
    assert figures[0] == ["run", "workers", "train time", "eval time", "tokens/s", "speedup", "efficiency",
                          "eval loss", "perplexity"]
    assert figures[2][:7] == ["distributed", "4", "22.0 s", "1.2 s", "1,815", "1.50x", "38%"]
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
    assert page.goto(f"{server_url}/runs/scheduled__2026-11-28T02_00_00_00_00/charts/report.json").status == 404
    assert page.goto(f"{server_url}/runs/..%2F..%2Fdatasets/").status == 404
    api = page.goto(f"{server_url}/api/runs")
    assert [run["status"] for run in api.json()] == ["failed", "passed", "no report yet"]


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
runs = TestClient(app).get("/gpt-finetune/api/runs").json()
errors = plugins_manager.get_import_errors()
shadowed = sorted(name for name in sys.stdlib_module_names if getattr(sys.modules.get(name), "__file__", "")
                  and "/plugins/" in sys.modules[name].__file__)
print(json.dumps({"info": info, "runs": [run["run_id"] for run in runs], "errors": errors, "shadowed": shadowed},
                 default=str))
"""
    env = {key: value for key, value in os.environ.items() if not key.startswith("AIRFLOW")}
    env.update({"AIRFLOW_HOME": str(tmp_path), "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
                "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "GPT_FINETUNE_STORAGE_ROOT": storage_root})
    result = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
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
    assert loaded["runs"] == ["scheduled__2026-11-29T02:00:00+00:00", "scheduled__2026-11-28T02:00:00+00:00",
                              "manual__training"]


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
    page = client.get("/runs/scheduled__2026-11-28T02_00_00_00_00/")
    assert page.status_code == 200 and "<td>1.10x</td>" in page.text
    chart = client.get("/runs/scheduled__2026-11-28T02_00_00_00_00/charts/scaling.png")
    assert chart.headers["content-type"] == "image/png" and chart.content.startswith(b"\x89PNG")


def test_the_nav_entry_shows_the_reports_inside_airflow(airflow_stack, storage_root, browser):
    """The real API server mounts the app; after logging in, the UI's navigation entry frames its pages."""
    stack_storage = Path(airflow_stack.env["GPT_FINETUNE_STORAGE_ROOT"])
    run_key = "scheduled__2026-11-28T02_00_00_00_00"
    shutil.copytree(Path(storage_root) / "runs" / run_key, stack_storage / "runs" / run_key, dirs_exist_ok=True)
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
