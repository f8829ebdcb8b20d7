"""The run-report pages' routes: every run under the storage root with its headline figures, and one run's report.

A plain FastAPI app that reads `<root>/runs/<run_key>/report/report.json` (and the PNG charts beside it) through
`runs_data.py` and writes its pages with `report_pages.py`, so the same pages serve local disk and S3. It has no
Airflow import: the plugin module mounts it into the API server and passes in Airflow's access check (`access`) and
login URL; tests serve it with uvicorn directly.

Reports come from storage that many tasks can write, so nothing read from it is trusted: every value is escaped,
a report with missing fields or wrong types becomes an error row (never a failed page), responses forbid scripts
(Content-Security-Policy), and error texts name runs, never storage URLs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.layout import StorageLayout, absolute_root
from gpt_finetune_ui import runs_data
from gpt_finetune_ui.report_pages import render_index, render_run

STORAGE_ROOT_ENV = "GPT_FINETUNE_STORAGE_ROOT"
# Pages are static HTML: no script may run, only same-origin images and the inline style; framed only by Airflow.
SECURITY_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; img-src 'self'; style-src 'unsafe-inline'; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'self'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


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
    _answer_errors(app, login_url)
    _serve_runs(app, lambda: StorageLayout(storage_root or default_storage_root()))
    return app


def _answer_errors(app: FastAPI, login_url: str | None) -> None:
    """Security headers on every answer; a page's 401 redirects to the login; storage errors as HTTP statuses."""

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

    @app.exception_handler(runs_data.NotFound)
    async def not_found(request: Request, error: runs_data.NotFound) -> Response:
        return await http_exception_handler(request, HTTPException(404, str(error)))

    @app.exception_handler(runs_data.UnreadableReport)
    async def unreadable(request: Request, error: runs_data.UnreadableReport) -> Response:
        return await http_exception_handler(request, HTTPException(422, str(error)))


def _serve_runs(app: FastAPI, layout: Callable[[], StorageLayout]) -> None:
    """The JSON API and the pages, each reading storage when asked."""

    @app.get("/api/runs")
    def runs_json() -> JSONResponse:
        return JSONResponse(runs_data.list_runs(layout()))

    @app.get("/api/runs/{run_key}")
    def run_json(run_key: str) -> JSONResponse:
        return JSONResponse(runs_data.read_report(layout(), run_key).to_json())

    @app.get("/api/models")
    def models_json() -> JSONResponse:
        return JSONResponse(runs_data.list_models(layout()))

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        return render_index(runs_data.list_runs(layout()), layout().root, models=runs_data.list_models(layout()))

    @app.get("/runs/{run_key}/", response_class=HTMLResponse)
    def run_page(run_key: str) -> str:
        return render_run(runs_data.read_report(layout(), run_key))

    @app.get("/runs/{run_key}/charts/{name}")
    def chart(run_key: str, name: str) -> Response:
        return Response(runs_data.read_chart(layout(), run_key, name), media_type="image/png",
                        headers={"Cache-Control": "max-age=60"})
