"""tf_multiworker.hook.StorageCredentialsHook: a storage connection read once, as AWS_* variables that reach this
process only inside `applied()`."""

from __future__ import annotations

import json
import os

import pytest
from tf_multiworker.hook import StorageCredentialsHook

CONNECTION = {"conn_type": "aws", "login": "key-id", "password": "secret-key",
              "extra": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1"}}
EXPECTED_ENV = {"AWS_ACCESS_KEY_ID": "key-id", "AWS_SECRET_ACCESS_KEY": "secret-key",
                "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-1"}


@pytest.fixture
def connection(monkeypatch):
    for name in EXPECTED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_RUN_STORE", json.dumps(CONNECTION))
    return "run_store"


def test_init_only_stores_the_connection_id(monkeypatch):
    """The operator builds its hook lazily; building one must not read a connection that does not exist yet."""
    hook = StorageCredentialsHook("defined_later")
    assert hook.storage_conn_id == "defined_later"
    monkeypatch.setenv("AIRFLOW_CONN_DEFINED_LATER", json.dumps(CONNECTION))
    assert hook.env == EXPECTED_ENV


def test_the_connection_is_read_once(connection, monkeypatch):
    hook = StorageCredentialsHook(connection)
    assert hook.env == EXPECTED_ENV
    monkeypatch.setenv("AIRFLOW_CONN_RUN_STORE", json.dumps({**CONNECTION, "login": "rotated"}))
    assert hook.env["AWS_ACCESS_KEY_ID"] == "key-id"


def test_applied_sets_the_variables_for_the_block_only(connection):
    with StorageCredentialsHook(connection).applied() as env:
        assert env == EXPECTED_ENV
        assert {name: os.environ[name] for name in EXPECTED_ENV} == EXPECTED_ENV
    assert not any(name in os.environ for name in EXPECTED_ENV)


def test_without_a_connection_the_environment_s_credentials_are_used(monkeypatch):
    for name in EXPECTED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    hook = StorageCredentialsHook()
    assert hook.env == {"AWS_ACCESS_KEY_ID": "from-env"}
    with hook.applied():
        assert os.environ["AWS_ACCESS_KEY_ID"] == "from-env"
    assert os.environ["AWS_ACCESS_KEY_ID"] == "from-env"
