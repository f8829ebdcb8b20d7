"""Airflow Connection -> environment variables for object storage.

Credentials travel only as environment variables (to this task process and to workers), never in configs, argv,
logs or XCom. An empty connection id means the environment already carries them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

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
    """The AWS_* variables for connection `conn_id` (aws type: login/password = keys, extras = endpoint/region)."""
    if not conn_id:
        return {}
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
