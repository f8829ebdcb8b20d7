"""How long the run's GPU tasks waited for admission, read from Airflow's own records through its public REST API.

The Task SDK's context gives a task neither its own nor another task instance's scheduled or queued time, so release
asks the API server (Airflow 3.3, `/api/v2`): every try of each GPU task of its DAG run
(`GET /api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries`, fields `scheduled_when`,
`queued_when`, `start_date`), with a JWT from `POST /auth/token` (`{"username", "password"}`, the simple auth
manager's and the FAB auth manager's login). Both go through an Airflow connection (`API_CONN_ID`, or the one
`GPT_FINETUNE_API_CONN_ID` names; type http: host with or without scheme, port, login, password), so the password
stays in the secrets backend and never reaches a log, an XCom or an argv.

A try waited for admission from `scheduled_when` (its dependencies met) to `queued_when` (the scheduler gave it its
pool slots, `gpu_slots` on GPU runs, and sent it to the executor): no slot was this run's then, so that time is
"waited" and costs nothing (tasks/usage.py takes it out of the held time between tasks). `queued_s` (queued ->
started) is shown beside it: the slots were the run's by then.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

log = logging.getLogger("gpt_finetune.airflow_api")

API_CONN_ID = "gpt_finetune_api"
API_CONN_ENV = "GPT_FINETUNE_API_CONN_ID"
TIMEOUT_S = 5.0  # per request: release holds the run's end, never the GPUs (they are released by then)


class ApiUnavailable(Exception):
    """The waits cannot be read; the message says why and what to set (never a credential)."""


def conn_id(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(API_CONN_ENV, "").strip() or API_CONN_ID


def base_url(conn: Any) -> str:
    """The API server's address from an http connection: `host` may carry the scheme; else `schema` or http."""
    host = (conn.host or "").strip().rstrip("/")
    if not host:
        raise ApiUnavailable(f"connection {conn.conn_id!r} names no host: set it to the API server's address")
    if "://" not in host:
        host = f"{(conn.schema or 'http').strip()}://{host}"
    return host + (f":{conn.port}" if conn.port else "")


def _request(url: str, *, token: str | None = None, body: Mapping[str, Any] | None = None) -> Any:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise ApiUnavailable(f"{urllib.parse.urlsplit(url).path} answered HTTP {error.code} {error.reason}") from None
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as error:
        raise ApiUnavailable(f"{urllib.parse.urlsplit(url).path}: {type(error).__name__}: {error}") from None


def task_tries(dag_id: str, run_id: str, task_ids: Iterable[str], *, connection: Any = None) -> list[dict[str, Any]]:
    """Every try of each task of the DAG run, as the API lists them (ApiUnavailable saying why when it cannot)."""
    if connection is None:
        from airflow.sdk import BaseHook

        name = conn_id()
        try:
            connection = BaseHook.get_connection(name)
        except Exception as error:  # noqa: BLE001 - the SDK raises AirflowNotFoundException and transport errors
            raise ApiUnavailable(
                f"no Airflow connection {name!r} ({type(error).__name__}): add one of type http naming the API "
                f"server (host, port, login, password of a user who may read task instances), or set "
                f"{API_CONN_ENV} to one") from None
    base = base_url(connection)
    if not connection.login:
        raise ApiUnavailable(f"connection {connection.conn_id!r} has no login: set the API user's login and password")
    token = _request(f"{base}/auth/token", body={"username": connection.login, "password": connection.password or ""})
    access = token.get("access_token") if isinstance(token, dict) else None
    if not access:
        raise ApiUnavailable("/auth/token answered without an access_token")
    run_path = f"{base}/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
    tries = []
    for task_id in sorted(set(task_ids)):
        page = _request(f"{run_path}/taskInstances/{urllib.parse.quote(task_id, safe='')}/tries", token=access)
        tries += [row for row in (page.get("task_instances") or []) if isinstance(row, dict)]
    return tries


def _epoch(stamp: Any) -> float | None:
    try:
        return datetime.fromisoformat(stamp).timestamp() if isinstance(stamp, str) else None
    except ValueError:
        return None


def admission_waits(tries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One entry per try that was admitted: {"task_id", "try_number", "map_index", "scheduled", "queued", "started"
    (epoch seconds), "waited_s" (scheduled -> queued), "queued_s" (queued -> started, None before it started)}. A try
    without a scheduled or queued time (never admitted, or a record from before these fields) is left out."""
    waits = []
    for row in tries:
        scheduled, queued, started = (_epoch(row.get(k)) for k in ("scheduled_when", "queued_when", "start_date"))
        if scheduled is None or queued is None:
            continue
        waits.append({"task_id": row.get("task_id"), "try_number": row.get("try_number"),
                      "map_index": row.get("map_index"), "scheduled": scheduled, "queued": queued, "started": started,
                      "waited_s": round(max(0.0, queued - scheduled), 3),
                      "queued_s": round(max(0.0, started - queued), 3) if started is not None else None})
    return sorted(waits, key=lambda wait: wait["scheduled"])
