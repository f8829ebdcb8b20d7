"""How long the run's GPU tasks waited for admission, read from Airflow's own records through its public REST API.

The Task SDK's context gives a task neither its own nor another task instance's scheduled or queued time, so release
asks the API server (Airflow 3.3, `/api/v2`): every try of each GPU task of its DAG run (`GET
/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries`, fields `scheduled_when`, `queued_when`,
`start_date`), through httpx with a JWT from `POST /auth/token` (`{"username", "password"}`, the simple auth
manager's and the FAB auth manager's login). Both go through an Airflow connection (`API_CONN_ID`, or the one
`GPT_FINETUNE_API_CONN_ID` names; type http: host with or without scheme, port, login, password), so the password
stays in the secrets backend and never reaches a log, an XCom or an argv.

A try waited for admission from `scheduled_when` (its dependencies met) to `queued_when` (the scheduler gave it its
pool slots, `gpu_slots` on GPU runs, and sent it to the executor): no slot was this run's then, so that time is
"waited" and costs nothing (tasks/ledger/usage.py takes it out of the held time between tasks). `queued_s` (queued
-> started) is shown beside it: the slots were the run's by then.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import httpx

from core.document import Document, DocumentError

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


def _call(client: httpx.Client, url: str, *, body: Mapping[str, str] | None = None) -> Any:
    """One JSON request (POST with `body`, else GET); ApiUnavailable naming the endpoint and what went wrong."""
    endpoint = urllib.parse.urlsplit(url).path
    try:
        response = client.post(url, json=body) if body is not None else client.get(url)
        response.raise_for_status()
        return response.json()
    except httpx.HTTPStatusError as error:
        status = error.response
        raise ApiUnavailable(f"{endpoint} answered HTTP {status.status_code} {status.reason_phrase}") from None
    except (httpx.HTTPError, ValueError) as error:
        raise ApiUnavailable(f"{endpoint}: {type(error).__name__}: {error}") from None


@dataclass(frozen=True)
class TaskTry(Document):
    """One try of a task instance as `GET .../taskInstances/{task_id}/tries` lists it (`task_instances`): the fields
    the waits need, checked (the API's other fields are not read). The times are ISO timestamps, None before the try
    reached that state (or in records from before these fields)."""

    task_id: str
    try_number: int
    map_index: int
    scheduled_when: str | None = None
    queued_when: str | None = None
    start_date: str | None = None

    def __post_init__(self) -> None:
        for name in ("scheduled_when", "queued_when", "start_date"):
            stamp = getattr(self, name)
            try:
                if stamp is not None:
                    datetime.fromisoformat(stamp)
            except ValueError:
                raise DocumentError(f"TaskTry.{name}: {stamp!r} is not an ISO timestamp: refusing the try.") from None

    @classmethod
    def from_api(cls, row: Any, endpoint: str) -> TaskTry:
        """`row` of the answer of `endpoint`; ApiUnavailable naming the endpoint and the field otherwise."""
        known = {field.name for field in fields(cls)}
        try:
            return cls.from_xcom({k: v for k, v in row.items() if k in known} if isinstance(row, Mapping) else row)
        except DocumentError as error:
            raise ApiUnavailable(f"{endpoint} answered a try that is not one: {error}") from None


def task_tries(dag_id: str, run_id: str, task_ids: Iterable[str], *, connection: Any = None) -> list[TaskTry]:
    """Every try of each task of the DAG run, as the API lists them (ApiUnavailable saying why when it cannot, or
    naming the endpoint and the field of an answer that is not what Airflow's API answers)."""
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
    with httpx.Client(timeout=TIMEOUT_S, headers={"Accept": "application/json"}) as client:
        token = _call(client, f"{base}/auth/token",
                      body={"username": connection.login, "password": connection.password or ""})
        access = token.get("access_token") if isinstance(token, dict) else None
        if not access:
            raise ApiUnavailable("/auth/token answered without an access_token")
        client.headers["Authorization"] = f"Bearer {access}"
        return _tries(client, f"{base}/api/v2/dags/{urllib.parse.quote(dag_id, safe='')}/dagRuns/"
                              f"{urllib.parse.quote(run_id, safe='')}", task_ids)


def _tries(client: httpx.Client, run_url: str, task_ids: Iterable[str]) -> list[TaskTry]:
    tries = []
    for task_id in sorted(set(task_ids)):
        url = f"{run_url}/taskInstances/{urllib.parse.quote(task_id, safe='')}/tries"
        endpoint = urllib.parse.urlsplit(url).path
        page = _call(client, url)
        rows = page.get("task_instances") if isinstance(page, dict) else None
        if not isinstance(rows, list):
            raise ApiUnavailable(f"{endpoint} answered without a list of task_instances: not Airflow's API?")
        tries += [TaskTry.from_api(row, f"{endpoint} task_instances[{index}]") for index, row in enumerate(rows)]
    return tries


def _epoch(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp).timestamp() if stamp is not None else None


@dataclass(frozen=True)
class AdmissionWait:
    """An admitted try's wait: `scheduled`, `queued`, `started` (epoch seconds; started None before it started),
    `waited_s` (scheduled -> queued) and `queued_s` (queued -> started)."""

    task_id: str
    try_number: int
    map_index: int
    scheduled: float
    queued: float
    started: float | None
    waited_s: float
    queued_s: float | None


def admission_waits(tries: Sequence[TaskTry]) -> list[AdmissionWait]:
    """One wait per try that was admitted, by scheduled time. A try without a scheduled or queued time (never
    admitted, or a record from before these fields) is left out."""
    waits = []
    for row in tries:
        scheduled, queued, started = (_epoch(t) for t in (row.scheduled_when, row.queued_when, row.start_date))
        if scheduled is None or queued is None:
            continue
        waits.append(AdmissionWait(row.task_id, row.try_number, row.map_index, scheduled, queued, started,
                                   waited_s=round(max(0.0, queued - scheduled), 3),
                                   queued_s=round(max(0.0, started - queued), 3) if started is not None else None))
    return sorted(waits, key=lambda wait: wait.scheduled)
