"""The run-report pages: every run under the storage root with its headline figures, and one run's report.

A plain FastAPI app that reads `<root>/runs/<run_key>/report/report.json` (and the PNG charts beside it) through
`trainer.storage`, so the same pages serve local disk and S3. It has no Airflow import: the plugin module mounts
it into the API server and passes in Airflow's access check (`access`) and login URL; tests serve it with uvicorn
directly.

Reports come from storage that many tasks can write, so nothing read from it is trusted: every value is escaped,
a report with missing fields or wrong types becomes an error row (never a failed page), responses forbid scripts
(Content-Security-Policy), and error texts name runs, never storage URLs.
"""

from __future__ import annotations

import html
import logging
import math
import os
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tasks.formatting import KNOWN_WORDS_NOTE, TABLE_COLUMNS
from tasks.registry import RegistryError, read_latest
from trainer.layout import StorageLayout, absolute_root
from trainer.storage import exists, join, list_dir, read_bytes, read_json

log = logging.getLogger("gpt_finetune.ui")

STORAGE_ROOT_ENV = "GPT_FINETUNE_STORAGE_ROOT"
# What trainer.layout.run_key produces, matched whole: no leading dot (no `.` or `..`), no `/`, no newline.
_RUN_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}")
_CHART_FILE = re.compile(r"[A-Za-z0-9_-]{1,100}\.png")
NUMBER = (int, float)
# Pages are static HTML: no script may run, only same-origin images and the inline style; framed only by Airflow.
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'self'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #1b1f24; }
table { border-collapse: collapse; margin: 0.8rem 0; }
th, td { border: 1px solid #d0d7de; padding: 0.35rem 0.7rem; text-align: right; }
th { background: #f6f8fa; } td { white-space: nowrap; } td:first-child, th:first-child { text-align: left; }
.pass { color: #1a7f37; font-weight: 600; } .fail { color: #cf222e; font-weight: 600; }
.note { color: #57606a; max-width: 60rem; } img { max-width: 100%; border: 1px solid #d0d7de; margin: 0.5rem 0; }
.warning { color: #9a6700; background: #fff8c5; border: 1px solid #d4a72c; padding: 0.5rem 1.5rem; max-width: 60rem; }
"""


class ReportError(ValueError):
    """A report.json that is not what tasks/report.py writes: a field is missing or has the wrong type."""


def default_storage_root() -> str:
    return absolute_root(os.environ.get(STORAGE_ROOT_ENV, "storage"))


def create_app(storage_root: str | None = None, *, access: Callable[..., Any] | None = None,
               login_url: str | None = None) -> FastAPI:
    """The app for `storage_root` (default: $GPT_FINETUNE_STORAGE_ROOT, else <repo>/storage), read per request.

    `access` is a FastAPI dependency run before every route (in Airflow: logged in and allowed to read the DAG's
    runs); it raises HTTP 401/403. Browser pages answer a 401 with a redirect to `login_url?next=<page>`, JSON
    routes (`/api/...`) keep the 401/403.
    """
    app = FastAPI(title="GPT fine-tune reports", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(access)] if access else [])

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Callable) -> Response:
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def login_redirect(request: Request, error: StarletteHTTPException) -> Response:
        is_page = not request.url.path.removeprefix(request.scope.get("root_path", "")).startswith("/api/")
        if error.status_code == 401 and login_url and is_page:
            return RedirectResponse(f"{login_url}?{urlencode({'next': str(request.url)})}", status_code=303)
        return await http_exception_handler(request, error)

    def layout() -> StorageLayout:
        return StorageLayout(storage_root or default_storage_root())

    def report_url(run_key: str) -> str:
        if not _RUN_KEY.fullmatch(run_key):
            raise HTTPException(404, "No such run")
        return layout().run(run_key).report

    def load_report(run_key: str) -> dict[str, Any]:
        url = join(report_url(run_key), "report.json")
        if not exists(url):
            raise HTTPException(404, f"Run {run_key} has no report: its evaluate task has not finished.")
        try:
            report = read_json(url)
        except ValueError as error:
            log.warning("Run %s: unreadable report %s (%s)", run_key, url, error)
            raise HTTPException(422, f"Run {run_key} has an unreadable report.") from error
        if not isinstance(report, dict):
            raise HTTPException(422, f"Run {run_key} has an unreadable report.")
        return report

    @app.get("/api/runs")
    def runs_json() -> JSONResponse:
        return JSONResponse(list_runs(layout()))

    @app.get("/api/runs/{run_key}")
    def run_json(run_key: str) -> JSONResponse:
        return JSONResponse(load_report(run_key))

    @app.get("/api/models")
    def models_json() -> JSONResponse:
        return JSONResponse(list_models(layout()))

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return render_index(list_runs(layout()), layout().root, models=list_models(layout()))

    @app.get("/runs/{run_key}/", response_class=HTMLResponse)
    def run_page(run_key: str) -> str:
        report = load_report(run_key)
        return render_run(report, release_status(layout().run(run_key).release))

    @app.get("/runs/{run_key}/charts/{name}")
    def chart(run_key: str, name: str) -> Response:
        charts = load_report(run_key).get("charts")
        if not _CHART_FILE.fullmatch(name) or not isinstance(charts, dict) or name not in charts.values():
            raise HTTPException(404, f"Run {run_key} has no such chart")  # only files the report names
        url = join(report_url(run_key), name)
        if not exists(url):
            raise HTTPException(404, f"Run {run_key}: chart {name} is missing")
        return Response(read_bytes(url), media_type="image/png", headers={"Cache-Control": "max-age=60"})

    return app


def release_status(release_url: str) -> str:
    """yes / no (something of the run outlived its release) / pending (release has not run), from release.json."""
    if not exists(release_url):
        return "pending"
    try:
        return "yes" if read_json(release_url).get("clean") is True else "no"
    except (OSError, ValueError, AttributeError) as error:  # e.g. a directory, a list: never a 500 for the index
        log.warning("Unreadable release record %s (%s)", release_url, error)
        return "no"


def _field(report: Any, path: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """`report[a][b]...` for `path` "a.b...", checked to be of `kind` (numbers: int or float, never bool)."""
    value = report
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ReportError(f"field {path!r} is missing")
        value = value[part]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):  # bool is an int subclass
        raise ReportError(f"field {path!r} is a {type(value).__name__}")
    return value


def headline(key: str, report: Any) -> dict[str, Any]:
    """The index row of one report; ReportError when a field it shows is missing or of the wrong type."""
    has_baseline = isinstance(report, dict) and isinstance(report.get("runs"), dict) and \
        report["runs"].get("baseline") is not None
    return {
        "run_key": key,
        "run_id": _field(report, "run_id", str),
        "status": "passed" if _field(report, "gates_passed", bool) else "failed",
        "created_at": _field(report, "created_at", str),
        "num_workers": _field(report, "num_workers", int),
        "speedup": _field(report, "comparison.speedup", NUMBER, optional=True),
        "efficiency": _field(report, "comparison.efficiency", NUMBER, optional=True),
        "tokens_per_s": _field(report, "runs.distributed.tokens_per_s", NUMBER, optional=True),
        "train_time_s": _field(report, "runs.distributed.train_time_s", NUMBER, optional=True),
        "eval_loss": _field(report, "runs.distributed.eval_loss", NUMBER, optional=True),
        "baseline_eval_loss": _field(report, "runs.baseline.eval_loss", NUMBER, optional=True) if has_baseline
        else None,
        "known_words": {mode: _field(report, f"runs.distributed.known_words.{mode}", NUMBER, optional=True)
                        for mode in ("greedy", "top_k")},
    }


def list_runs(storage: StorageLayout) -> list[dict[str, Any]]:
    """Headline figures of every run with a report, newest first; runs without one are listed as pending, runs
    whose report cannot be read or has wrong types as an error row."""
    runs = []
    for key in list_dir(storage.runs):
        url = join(storage.run(key).report, "report.json")
        released = release_status(storage.run(key).release)
        if not exists(url):
            runs.append({"run_key": key, "run_id": key, "status": "no report yet", "released": released})
            continue
        try:
            runs.append({**headline(key, read_json(url)), "released": released})
        except ValueError as error:  # ReportError and JSON decoding errors
            log.warning("Run %s: unreadable report %s (%s)", key, url, error)
            detail = error if isinstance(error, ReportError) else "not valid JSON"
            runs.append({"run_key": key, "run_id": key, "status": f"unreadable report: {detail}", "released": released})
    # created_at has whole seconds: runs of one second are ordered by run id (scheduled ids sort by date).
    return sorted(runs, key=lambda run: (run.get("created_at") or "", run["run_id"]), reverse=True)


def list_models(storage: StorageLayout) -> list[dict[str, Any]]:
    """Every registered model: its latest version, the run that produced it and the version history (newest
    first), from latest.json alone; an unreadable pointer becomes an error entry."""
    models = []
    for name in list_dir(storage.models):
        try:
            pointer = read_latest(storage.model(name))
        except (RegistryError, OSError, ValueError) as error:
            log.warning("Model %s: unreadable pointer (%s)", name, error)
            models.append({"name": name, "error": "unreadable latest.json"})
            continue
        if pointer is None:  # a claim or a half-written version, never a promotion
            continue
        history = [{field: entry.get(field) for field in ("version", "run_id", "run_key", "promoted_at", "eval_loss")}
                   for entry in pointer["history"] if isinstance(entry, dict)]
        models.append({"name": name, "latest": pointer.get("version"), "run_id": pointer.get("run_id"),
                       "run_key": pointer.get("run_key"), "promoted_at": pointer.get("promoted_at"),
                       "eval_loss": pointer.get("eval_loss"), "history": history[::-1]})
    return models


# ---------------------------------------------------------------------------------------------------------------
# HTML: every value from storage goes through _text or _fmt, which escape it whatever its type


def _text(value: Any) -> str:
    return "—" if value is None else html.escape(str(value))


def _known_words(figures: Any) -> str:
    """`greedy / top-k` known-word rates; a report from before they existed shows dashes."""
    figures = figures if isinstance(figures, dict) else {}
    return " / ".join(_fmt(figures.get(mode), ".0f", "%", scale=100) for mode in ("greedy", "top_k"))


def _fmt(value: Any, spec: str, suffix: str = "", scale: float = 1) -> str:
    """A number (times `scale`) formatted for people; anything else (a report with wrong types) is shown escaped as
    it is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{value * scale:{spec}}{suffix}"
    return _text(value)


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>")


def _status(status: str) -> str:
    css = {"passed": "pass", "yes": "pass", "failed": "fail", "no": "fail"}.get(status, "note")
    return f"<span class='{css}'>{_text(status)}</span>"


def render_index(runs: list[dict[str, Any]], root: str, *, models: list[dict[str, Any]] | None = None) -> str:
    header = ("<tr><th>run</th><th>gates</th><th>released</th><th>workers</th><th>speedup</th><th>efficiency</th>"
              "<th>tokens/s</th><th>train time</th><th>eval loss</th><th>baseline eval loss</th>"
              "<th title='share of the words in the distributed model's greedy / top-k samples that occur in the "
              "training text'>known words</th><th>created</th></tr>")
    rows = []
    for run in runs:
        if "created_at" not in run:  # nothing to show: no link to a page that would say so
            rows.append(f"<tr><td>{_text(run['run_id'])}</td><td>{_status(run['status'])}</td>"
                        f"<td>{_status(run['released'])}</td><td colspan='9'></td></tr>")
            continue
        link = f"<a href='runs/{_text(run['run_key'])}/'>{_text(run['run_id'])}</a>"
        efficiency = None if run["efficiency"] is None else 100 * run["efficiency"]
        rows.append(
            f"<tr><td>{link}</td><td>{_status(run['status'])}</td><td>{_status(run['released'])}</td>"
            f"<td>{_text(run['num_workers'])}</td>"
            f"<td>{_fmt(run['speedup'], '.2f', 'x')}</td><td>{_fmt(efficiency, '.0f', '%')}</td>"
            f"<td>{_fmt(run['tokens_per_s'], ',.0f')}</td><td>{_fmt(run['train_time_s'], '.1f', ' s')}</td>"
            f"<td>{_fmt(run['eval_loss'], '.4f')}</td><td>{_fmt(run['baseline_eval_loss'], '.4f')}</td>"
            f"<td>{_known_words(run['known_words'])}</td><td>{_text(run['created_at'])}</td></tr>"
        )
    table = f"<table id='runs'>{header}{''.join(rows)}</table>" if rows else "<p>No runs yet.</p>"
    return _page("GPT fine-tune runs", f"<h1>GPT fine-tune runs</h1><p class='note'>Storage root: "
                                       f"<code>{_text(root)}</code></p>{table}"
                                       + (render_models(models) if models is not None else ""))


def _run_link(run_key: Any, text: Any, prefix: str = "") -> str:
    """A link to a run's page when `run_key` is a run key, else the text alone."""
    if isinstance(run_key, str) and _RUN_KEY.fullmatch(run_key):
        return f"<a href='{prefix}runs/{html.escape(run_key)}/'>{_text(text)}</a>"
    return _text(text)


def render_models(models: list[dict[str, Any]]) -> str:
    """Per registered model: which run produced `latest`, and the version history with links to the reports."""
    if not models:
        return "<h2>Promoted models</h2><p>No model promoted yet.</p>"
    parts = ["<h2>Promoted models</h2>"]
    for model in models:
        name = _text(model["name"])
        if "error" in model:
            parts.append(f"<p class='fail'>{name}: {_text(model['error'])}</p>")
            continue
        parts.append(
            f"<p class='latest' id='latest-{name}'>{name}: latest is <b>{_text(model['latest'])}</b>, produced by "
            f"run {_run_link(model['run_key'], model['run_id'])} on {_text(model['promoted_at'])} "
            f"(eval loss {_fmt(model['eval_loss'], '.4f')})</p>"
            f"<table class='history' id='history-{name}'><tr><th>version</th><th>promoted</th><th>eval loss</th>"
            "<th>run report</th></tr>"
            + "".join(f"<tr><td>{_text(entry['version'])}</td><td>{_text(entry['promoted_at'])}</td>"
                      f"<td>{_fmt(entry['eval_loss'], '.4f')}</td>"
                      f"<td>{_run_link(entry['run_key'], entry['run_id'])}</td></tr>" for entry in model["history"])
            + "</table>")
    return "".join(parts)


def render_promotion(report: dict[str, Any]) -> str:
    promotion = report.get("promotion")
    continued = report.get("continued_from")
    lines = []
    if isinstance(continued, dict):
        lines.append(f"Continued from {_text(continued.get('name'))} {_text(continued.get('version'))} "
                     f"(run {_text(continued.get('run_id'))}).")
    if not isinstance(promotion, dict):
        lines.append("Promotion: pending.")
    elif promotion.get("promoted") is True:
        lines.append(f"Promotion: <span class='pass'>promoted</span> to {_text(promotion.get('model_name'))} "
                     f"{_text(promotion.get('version'))}: {_text(promotion.get('reason'))}")
    else:
        lines.append(f"Promotion: <span class='fail'>not promoted</span> (policy {_text(promotion.get('policy'))}): "
                     f"{_text(promotion.get('reason'))}")
    return "".join(f"<p class='note promotion'>{line}</p>" for line in lines)


def render_scaling(report: dict[str, Any]) -> str:
    """An elastic run's segments and the advisor's predicted scaling next to the measured one (as in report.md)."""
    parts = []
    segments = _items(report.get("segments"))
    if report.get("elastic") is True and segments:
        rows = "".join(
            f"<tr><td>{_steps(segment)}</td><td>{_text(segment.get('num_workers'))} of "
            f"{_text(report.get('num_workers'))}</td><td>{_text(segment.get('grad_accum_steps'))}</td>"
            f"<td>{_fmt(segment.get('tokens_per_s'), ',.0f')}</td>"
            f"<td style='text-align:left'>{_text(segment.get('line'))}</td></tr>" for segment in segments)
        parts.append("<h2>Segments (elastic recovery)</h2><table id='segments'><tr><th>steps</th><th>workers</th>"
                     "<th>accumulation</th><th>tokens/s</th><th style='text-align:left'>what happened</th></tr>"
                     f"{rows}</table>")
    predicted = report.get("prediction")
    if isinstance(predicted, dict):
        cells = [_text(predicted.get("num_workers")), _fmt(predicted.get("predicted_speedup"), ".2f", "x"),
                 _fmt(predicted.get("measured_speedup"), ".2f", "x"),
                 _fmt(predicted.get("predicted_efficiency"), ".0f", "%", scale=100),
                 _fmt(predicted.get("measured_efficiency"), ".0f", "%", scale=100)]
        parts.append("<h2>Scaling: predicted (preflight advisor) vs measured</h2><table id='prediction'><tr>"
                     "<th>workers</th><th>predicted speedup</th><th>measured speedup</th><th>predicted efficiency</th>"
                     "<th>measured efficiency</th></tr><tr>" + "".join(f"<td>{cell}</td>" for cell in cells)
                     + f"</tr></table><p class='note'>Advisor (single-worker step from the "
                     f"{_text(predicted.get('step_source'))}): {_text(predicted.get('recommendation'))}</p>")
    return "".join(parts)


def _steps(segment: dict[str, Any]) -> str:
    first, last = segment.get("from_step"), segment.get("to_step")
    if all(isinstance(step, int) and not isinstance(step, bool) for step in (first, last)):
        return f"{first + 1}-{last}"
    return f"{_text(first)}-{_text(last)}"


def render_samples(report: dict[str, Any]) -> str:
    """Per prompt, every model's greedy and top-k continuation."""
    sections = [section for section in _items(report.get("samples")) if _items(section.get("samples"))]
    if not sections:
        return ""
    quality = "".join(
        f"<tr><td>{_text(section.get('model'))}</td><td>{_fmt(section.get('eval_loss'), '.4f')}</td>"
        f"<td>{_fmt(section.get('nats_per_char'), '.3f')}</td><td>{_known_words(section.get('known_words'))}</td></tr>"
        for section in sections)
    parts = [("<h2>Samples</h2><p class='note'>Greedy and top-k continuations of the same prompts from the "
             "validation text (fixed seed).</p><table id='sample-quality'><tr><th>model</th><th>eval loss</th>"
              f"<th>nats/char</th><th>known words (greedy / top-k)</th></tr>{quality}</table>")]
    for index, first in enumerate(_items(sections[0].get("samples"))):
        rows = "".join(
            f"<tr><td>{_text(section.get('model'))}</td><td style='{_WRAP}'>{_text(sample.get('greedy'))}</td>"
            f"<td style='{_WRAP}'>{_text(sample.get('top_k'))}</td></tr>"
            for section in sections for sample in _items(section.get("samples"))[index:index + 1])
        parts.append(f"<p><b>Prompt {index + 1}:</b> {_text(first.get('prompt'))}</p><table class='samples'>"
                     f"<tr><th>model</th><th>greedy</th><th>top-k</th></tr>{rows}</table>")
    return "".join(parts)


_WRAP = "white-space:normal;text-align:left;max-width:30rem"


def _items(value: Any) -> list[dict[str, Any]]:
    """The dicts of a list from the report; anything else reads as none (a malformed report still renders)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _get(value: Any, *path: str) -> Any:
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def render_run(report: dict[str, Any], released: str) -> str:
    verdict = "passed" if report.get("gates_passed") is True else "failed"
    table = (
        "<table id='figures'><tr>" + "".join(f"<th>{html.escape(col)}</th>" for col in TABLE_COLUMNS) + "</tr>"
        + "".join("<tr>" + "".join(f"<td>{_text(row.get(col))}</td>" for col in TABLE_COLUMNS) + "</tr>"
                  for row in _items(report.get("table")))
        + f"</table><p class='note'>{html.escape(KNOWN_WORDS_NOTE)}</p>"
    )
    gates = (
        "<table id='gates'><tr><th>gate</th><th>result</th><th style='text-align:left'>detail</th></tr>"
        + "".join(f"<tr><td>{_text(gate.get('name'))}</td>"
                  f"<td>{_status('passed' if gate.get('passed') is True else 'failed')}</td>"
                  f"<td style='text-align:left'>{_text(gate.get('detail'))}</td></tr>"
                  for gate in _items(report.get("gates")))
        + "</table>"
    )
    listed = report.get("warnings") if isinstance(report.get("warnings"), list) else []
    warnings = "".join(f"<li>{_text(text)}</li>" for text in listed if isinstance(text, str))
    warning_list = f"<ul id='warnings' class='warning'>{warnings}</ul>" if warnings else ""
    charts = report.get("charts") if isinstance(report.get("charts"), dict) else {}
    images = "".join(f"<img alt='{_text(name)}' src='charts/{_text(file)}'>" for name, file in charts.items()
                     if isinstance(file, str) and _CHART_FILE.fullmatch(file))
    body = (
        f"<p><a href='../../'>All runs</a></p><h1>Run {_text(report.get('run_id'))}</h1>"
        f"<p>Gates {_status(verdict)} · released <span id='released'>{_status(released)}</span> · "
        f"{_text(report.get('num_workers'))} workers · model "
        f"{_text(_get(report, 'config', 'model'))} · created {_text(report.get('created_at'))}</p>"
        f"{warning_list}{table}"
        f"<p class='note' id='hardware'>{_text(_get(report, 'hardware', 'line'))}</p>{gates}"
        f"{render_scaling(report)}{render_promotion(report)}{render_samples(report)}{images}"
    )
    return _page(f"Run {report.get('run_id')}", body)
