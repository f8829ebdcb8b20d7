"""Airflow Connection -> environment variables for object storage.

Credentials travel only as environment variables (to this task process and to workers), never in configs, argv,
logs or XCom. An empty connection id means the environment already carries them. Every task that touches storage
goes through `uses_run_storage`, so none can forget the connection (release once did, and failed on S3).

A storage connection is of type `aws`: the login and password of any other connection (the metadata database's,
a mail server's) are no storage keys and are never handed on as such. A task never resolves a run's connection
that the access policy (core/config/access.py) does not allow.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from core.config import AccessPolicy, ConfigError
from core.config.access import STORAGE_CONN_IDS_ENV

if TYPE_CHECKING:
    from tasks.dataset.plan import DatasetPlan
    from tasks.prepared_run import PreparedRun

    RunSettings = Mapping[str, Any] | PreparedRun | DatasetPlan  # raw params, or a document with their `config`

log = logging.getLogger("gpt_finetune.connections")
STORAGE_CONN_TYPE = "aws"
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
    without a connection, those this process's environment holds (remote workers inherit nothing from it).
    A connection of another type is refused (ConfigError) without reading its secrets."""
    if not conn_id:
        names = (*_CONNECTION_ENV.values(), *_EXTRA_ENV.values())
        return {name: os.environ[name] for name in names if os.environ.get(name)}
    from airflow.sdk import BaseHook

    conn = BaseHook.get_connection(conn_id)
    if conn.conn_type != STORAGE_CONN_TYPE:
        raise ConfigError(
            f"Setting 'storage_conn_id' = {conn_id!r} names a connection of type {conn.conn_type!r}, but storage "
            f"connections are of type '{STORAGE_CONN_TYPE}' (login/password: the access key pair; extras "
            f"endpoint_url, region_name): name an {STORAGE_CONN_TYPE} connection that ${STORAGE_CONN_IDS_ENV} "
            "allows, or clear the setting for this environment's credentials.")
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


def run_storage_env(settings: RunSettings) -> dict[str, str]:
    """The variables of the run's storage connection. One that the access policy or its type refuses is never used:
    the task goes on with this environment's credentials (release must still run), and prepare refuses the run
    naming the setting."""
    conn_id = run_storage_conn_id(settings)
    try:
        AccessPolicy.from_env().check_allowed("storage_conn_id", conn_id)
        return storage_env(conn_id)
    except ConfigError as refusal:
        log.warning("%s This task reaches storage with this environment's credentials instead.", refusal)
        return storage_env("")


def run_storage_conn_id(settings: RunSettings) -> str:
    """The run's storage connection id, from its raw params, or from a prepared run or a dataset plan (their
    validated `config`).

    Read leniently: release must reach storage even for a run whose other settings were refused.
    """
    if not isinstance(settings, Mapping):  # a document: its config
        return run_storage_conn_id(settings.config)
    config = settings.get("config")
    conn_id = (config if isinstance(config, Mapping) else settings).get("storage_conn_id")
    return conn_id if isinstance(conn_id, str) else ""


def uses_run_storage(task_logic: TaskLogic) -> TaskLogic:
    """Run task logic whose first argument is the run's params or prepared run with its storage credentials applied."""

    @functools.wraps(task_logic)
    def with_storage_credentials(settings: RunSettings, *args: Any, **kwargs: Any) -> Any:
        with applied_env(run_storage_env(settings)):
            return task_logic(settings, *args, **kwargs)

    return with_storage_credentials  # type: ignore[return-value]
