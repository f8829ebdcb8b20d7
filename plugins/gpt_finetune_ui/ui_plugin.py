"""Registers the run-report pages with the Airflow 3 API server and adds them to the UI navigation.

Airflow 3.3 mounts plugin apps without any login, so the app is given Airflow's own access check: every route
requires a logged-in user (the UI's `_token` cookie or an API bearer token) who may read the runs of the
`gpt_finetune` DAG. Pages without a login redirect to Airflow's login page and come back; JSON routes answer
401/403.
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.api_fastapi.app import API_ROOT_PATH
from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import requires_access_dag
from airflow.plugins_manager import AirflowPlugin

from gpt_finetune_ui.reports_app import create_app

URL_PREFIX = "/gpt-finetune"
DAG_ID = "gpt_finetune"  # whose runs the reports are: reading them needs permission to read this DAG's runs
LOGIN_URL = f"{API_ROOT_PATH.rstrip('/')}/api/v2/auth/login"


class GptFinetuneReportsPlugin(AirflowPlugin):
    name = "gpt_finetune_reports"
    fastapi_apps: ClassVar[list[dict[str, Any]]] = [{
        "app": create_app(access=requires_access_dag("GET", DagAccessEntity.RUN, param_dag_id=DAG_ID),
                          login_url=LOGIN_URL),
        "url_prefix": URL_PREFIX,
        "name": "GPT fine-tune reports",
    }]
    # With url_route the UI shows the page inside Airflow (at /plugin/gpt-finetune-runs); href is relative to
    # the UI's base URL, so it also works behind a proxy path.
    external_views: ClassVar[list[dict[str, Any]]] = [{
        "name": "GPT fine-tune runs",
        "href": f"{URL_PREFIX.lstrip('/')}/",
        "url_route": "gpt-finetune-runs",
        "destination": "nav",
        "category": "browse",
    }]
