"""Registers the run-report pages with the Airflow 3 API server and adds them to the UI navigation."""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.plugins_manager import AirflowPlugin

from gpt_finetune_ui.reports_app import create_app

URL_PREFIX = "/gpt-finetune"


class GptFinetuneReportsPlugin(AirflowPlugin):
    name = "gpt_finetune_reports"
    fastapi_apps: ClassVar[list[dict[str, Any]]] = [
        {"app": create_app(), "url_prefix": URL_PREFIX, "name": "GPT fine-tune reports"},
    ]
    # With url_route the UI shows the page inside Airflow (at /plugin/gpt-finetune-runs); href is relative to
    # the UI's base URL, so it also works behind a proxy path.
    external_views: ClassVar[list[dict[str, Any]]] = [{
        "name": "GPT fine-tune runs",
        "href": f"{URL_PREFIX.lstrip('/')}/",
        "url_route": "gpt-finetune-runs",
        "destination": "nav",
        "category": "browse",
    }]
