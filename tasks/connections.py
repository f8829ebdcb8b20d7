"""Airflow Connection -> environment variables for object storage.

Credentials travel only as environment variables (to this task process and to workers), never in configs, argv,
logs or XCom. An empty connection id means the environment already carries them. Every task that touches storage
goes through `uses_run_storage`, so none can forget the connection (release once did, and failed on S3).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

TaskLogic = TypeVar("TaskLogic", bound=Callable[..., Any])

# Names botocore (and therefore s3fs) reads by itself.
_CONNECTION_ENV = {
    "login": "AWS_ACCESS_KEY_ID",
    "password": "AWS_SECRET_ACCESS_KEY",
}
_EXTRA_ENV = {
    "endpoint_url": "AWS_ENDPOINT_URL",
    "region_name": "AWS_DEFAULT_REGION",
    "aws_session_token": "AWS_SESSION_TOKEN",
}


def storage_env(conn_id: str) -> dict[str, str]:
    """The AWS_* variables for connection `conn_id` (aws type: login/password = keys, extras = endpoint/region);
    without a connection, those this process's environment holds (remote workers inherit nothing from it)."""
    if not conn_id:
        names = (*_CONNECTION_ENV.values(), *_EXTRA_ENV.values())
        return {name: os.environ[name] for name in names if os.environ.get(name)}
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    env = {name: getattr(conn, attr) for attr, name in _CONNECTION_ENV.items() if getattr(conn, attr)}
    extra = conn.extra_dejson
    env.update({name: str(extra[key]) for key, name in _EXTRA_ENV.items() if extra.get(key)})
    return env


@contextmanager
def applied_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """Set `env` in this process (fsspec/botocore read it) for the duration of the block, then restore."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def storage_credentials(conn_id: str) -> contextlib.AbstractContextManager[dict[str, str]]:
    """Apply the connection's variables to this process for the duration of the block."""
    return applied_env(storage_env(conn_id))


def run_storage_conn_id(settings: Mapping[str, Any]) -> str:
    """The run's storage connection id, from its raw params or from a prepared run (its validated `config`).

    Read leniently: release must reach storage even for a run whose other settings were refused.
    """
    config = settings.get("config")
    conn_id = (config if isinstance(config, Mapping) else settings).get("storage_conn_id")
    return conn_id if isinstance(conn_id, str) else ""


def uses_run_storage(task_logic: TaskLogic) -> TaskLogic:
    """Run task logic whose first argument is the run's params or prepared run with its storage credentials applied."""

    @functools.wraps(task_logic)
    def with_storage_credentials(settings: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        with storage_credentials(run_storage_conn_id(settings)):
            return task_logic(settings, *args, **kwargs)

    return with_storage_credentials  # type: ignore[return-value]
