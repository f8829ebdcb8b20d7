"""The run-report pages: every run under the storage root with its headline figures, and one run's report.

A plain FastAPI app that reads `<root>/runs/<run_key>/report/report.json` (and the PNG charts beside it) through
`trainer.storage`, so the same pages serve local disk and S3. It has no Airflow import: the plugin module mounts
it into the API server, and tests serve it with uvicorn directly.

Read-only, but Airflow does not put its login in front of plugin apps: expose the API server only where the
reports may be seen.
"""

from __future__ import annotations

import html
import logging
import os
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tasks.report import TABLE_COLUMNS
from trainer.layout import StorageLayout
from trainer.storage import exists, join, list_dir, normalize_root, read_bytes, read_json

log = logging.getLogger("gpt_finetune.ui")

STORAGE_ROOT_ENV = "GPT_FINETUNE_STORAGE_ROOT"
REPO_ROOT = Path(__file__).resolve().parents[2]
_RUN_KEY = re.compile(r"^[A-Za-z0-9._-]+$")  # what trainer.layout.run_key produces; refuses path tricks

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #1b1f24; }
table { border-collapse: collapse; margin: 0.8rem 0; }
th, td { border: 1px solid #d0d7de; padding: 0.35rem 0.7rem; text-align: right; }
th { background: #f6f8fa; } td { white-space: nowrap; } td:first-child, th:first-child { text-align: left; }
.pass { color: #1a7f37; font-weight: 600; } .fail { color: #cf222e; font-weight: 600; }
.note { color: #57606a; max-width: 60rem; } img { max-width: 100%; border: 1px solid #d0d7de; margin: 0.5rem 0; }
"""


def default_storage_root() -> str:
    return normalize_root(os.environ.get(STORAGE_ROOT_ENV, "storage"), relative_to=REPO_ROOT)


def create_app(storage_root: str | None = None) -> FastAPI:
    """The app for `storage_root` (default: $GPT_FINETUNE_STORAGE_ROOT, else <repo>/storage), read per request."""
    app = FastAPI(title="GPT fine-tune reports", docs_url=None, redoc_url=None, openapi_url=None)

    def layout() -> StorageLayout:
        return StorageLayout(storage_root or default_storage_root())

    def report_url(run_key: str) -> str:
        if not _RUN_KEY.match(run_key):
            raise HTTPException(404, f"No run {run_key!r}")
        return layout().run(run_key).report

    def load_report(run_key: str) -> dict[str, Any]:
        url = join(report_url(run_key), "report.json")
        if not exists(url):
            raise HTTPException(404, f"Run {run_key!r} has no report (no {url}): its evaluate task has not finished.")
        return read_json(url)

    @app.get("/api/runs")
    def runs_json() -> JSONResponse:
        return JSONResponse(list_runs(layout()))

    @app.get("/api/runs/{run_key}")
    def run_json(run_key: str) -> JSONResponse:
        return JSONResponse(load_report(run_key))

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return render_index(list_runs(layout()), layout().root)

    @app.get("/runs/{run_key}/", response_class=HTMLResponse)
    def run_page(run_key: str) -> str:
        report = load_report(run_key)
        return render_run(report, release_status(layout().run(run_key).release))

    @app.get("/runs/{run_key}/charts/{name}")
    def chart(run_key: str, name: str) -> Response:
        if name not in load_report(run_key).get("charts", {}).values():  # only files the report names
            raise HTTPException(404, f"Run {run_key!r} has no chart {name!r}")
        url = join(report_url(run_key), name)
        if not exists(url):
            raise HTTPException(404, f"Chart {url} is missing")
        return Response(read_bytes(url), media_type="image/png", headers={"Cache-Control": "max-age=60"})

    return app


def release_status(release_url: str) -> str:
    """yes / no (something of the run outlived its release) / pending (release has not run), from release.json."""
    if not exists(release_url):
        return "pending"
    try:
        return "yes" if read_json(release_url).get("clean") is True else "no"
    except (ValueError, AttributeError) as error:
        log.warning("Unreadable release record %s (%s)", release_url, error)
        return "no"


def list_runs(storage: StorageLayout) -> list[dict[str, Any]]:
    """Headline figures of every run with a report, newest first; runs without one are listed as pending."""
    runs = []
    for key in list_dir(storage.runs):
        url = join(storage.run(key).report, "report.json")
        released = release_status(storage.run(key).release)
        if not exists(url):
            runs.append({"run_key": key, "run_id": key, "status": "no report yet", "released": released})
            continue
        try:
            report = read_json(url)
            distributed, baseline = report["runs"]["distributed"], report["runs"].get("baseline")
            runs.append({
                "run_key": key,
                "run_id": report["run_id"],
                "status": "passed" if report["gates_passed"] else "failed",
                "released": released,
                "created_at": report["created_at"],
                "num_workers": report["num_workers"],
                "speedup": report["comparison"]["speedup"],
                "efficiency": report["comparison"]["efficiency"],
                "tokens_per_s": distributed["tokens_per_s"],
                "train_time_s": distributed["train_time_s"],
                "eval_loss": distributed["eval_loss"],
                "baseline_eval_loss": baseline["eval_loss"] if baseline else None,
            })
        except (ValueError, KeyError, TypeError) as error:
            log.warning("Run %s: unreadable report %s (%s)", key, url, error)
            runs.append({"run_key": key, "run_id": key, "status": f"unreadable report: {error}", "released": released})
    return sorted(runs, key=lambda run: run.get("created_at") or "", reverse=True)


# ---------------------------------------------------------------------------------------------------------------
# HTML


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>")


def _status(status: str) -> str:
    css = {"passed": "pass", "yes": "pass", "failed": "fail", "no": "fail"}.get(status, "note")
    return f"<span class='{css}'>{html.escape(status)}</span>"


def render_index(runs: list[dict[str, Any]], root: str) -> str:
    header = ("<tr><th>run</th><th>gates</th><th>released</th><th>workers</th><th>speedup</th><th>efficiency</th><th>tokens/s</th>"
              "<th>train time</th><th>eval loss</th><th>baseline eval loss</th><th>created</th></tr>")
    rows = []
    for run in runs:
        if "created_at" not in run:  # nothing to show yet: no link to a page that would say so
            rows.append(f"<tr><td>{html.escape(run['run_id'])}</td><td>{_status(run['status'])}</td>"
                        f"<td>{_status(run['released'])}</td><td colspan='8'></td></tr>")
            continue
        link = f"<a href='runs/{html.escape(run['run_key'])}/'>{html.escape(run['run_id'])}</a>"
        efficiency = None if run["efficiency"] is None else 100 * run["efficiency"]
        rows.append(
            f"<tr><td>{link}</td><td>{_status(run['status'])}</td><td>{_status(run['released'])}</td>"
            f"<td>{run['num_workers']}</td>"
            f"<td>{_fmt(run['speedup'], '.2f', 'x')}</td><td>{_fmt(efficiency, '.0f', '%')}</td>"
            f"<td>{_fmt(run['tokens_per_s'], ',.0f')}</td><td>{_fmt(run['train_time_s'], '.1f', ' s')}</td>"
            f"<td>{_fmt(run['eval_loss'], '.4f')}</td><td>{_fmt(run['baseline_eval_loss'], '.4f')}</td>"
            f"<td>{html.escape(run['created_at'])}</td></tr>"
        )
    table = f"<table id='runs'>{header}{''.join(rows)}</table>" if rows else "<p>No runs yet.</p>"
    return _page("GPT fine-tune runs", f"<h1>GPT fine-tune runs</h1><p class='note'>Storage root: "
                                       f"<code>{html.escape(root)}</code></p>{table}")


def render_run(report: dict[str, Any], released: str) -> str:
    verdict = "passed" if report["gates_passed"] else "failed"
    table = (
        "<table id='figures'><tr>" + "".join(f"<th>{html.escape(col)}</th>" for col in TABLE_COLUMNS) + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{html.escape(row[col])}</td>" for col in TABLE_COLUMNS) + "</tr>"
                  for row in report["table"])
        + "</table>"
    )
    gates = (
        "<table id='gates'><tr><th>gate</th><th>result</th><th style='text-align:left'>detail</th></tr>"
        + "".join(f"<tr><td>{html.escape(gate['name'])}</td><td>{_status('passed' if gate['passed'] else 'failed')}"
                  f"</td><td style='text-align:left'>{html.escape(gate['detail'])}</td></tr>"
                  for gate in report["gates"])
        + "</table>"
    )
    charts = "".join(f"<img alt='{html.escape(name)}' src='charts/{html.escape(file)}'>"
                     for name, file in report.get("charts", {}).items())
    config = report["config"]
    body = (
        f"<p><a href='../../'>All runs</a></p><h1>Run {html.escape(report['run_id'])}</h1>"
        f"<p>Gates {_status(verdict)} · released <span id='released'>{_status(released)}</span> · "
        f"{report['num_workers']} workers · model {html.escape(config['model'])} · "
        f"created {html.escape(report['created_at'])}</p>{table}"
        f"<p class='note' id='hardware'>{html.escape(report['hardware']['line'])}</p>{gates}{charts}"
    )
    return _page(f"Run {report['run_id']}", body)
