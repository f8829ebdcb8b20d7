"""Object-storage credentials from an Airflow Connection, as environment variables only.

Workers (and this task process, for the run-state record and the logs) read S3 credentials from the
environment (core/storage/). The values are never logged, put in argv, TF_CONFIG or XCom.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from functools import cached_property

from airflow.sdk import BaseHook


class StorageCredentialsHook(BaseHook):
    """An `aws` Connection: login/password are the keys, extras `endpoint_url` / `region_name` the endpoint."""

    conn_name_attr = "storage_conn_id"
    hook_name = "Object storage credentials"

    def __init__(self, storage_conn_id: str = "") -> None:
        super().__init__()
        self.storage_conn_id = storage_conn_id

    @cached_property
    def env(self) -> dict[str, str]:
        """AWS_* variables for the connection; empty when no connection is named (the environment has them)."""
        from tasks.connections import storage_env

        return storage_env(self.storage_conn_id)

    def applied(self) -> AbstractContextManager[dict[str, str]]:
        """Make the credentials visible to this process (fsspec/botocore) for the duration of the block."""
        from tasks.connections import applied_env

        return applied_env(self.env)
