"""tasks.connections: an Airflow Connection becomes AWS_* variables, applied to this process only for a block, and
every task that touches storage reaches the S3 server through its run's connection alone."""

from __future__ import annotations

import json
import logging
import os

import pytest
from airflow.sdk.exceptions import AirflowNotFoundException

from core.config import ConfigError
from core.storage import read_bytes, write_bytes_atomic
from tasks.connections import applied_env, run_storage_conn_id, storage_env, uses_run_storage
from tests.support.s3server import ACCESS_KEY, SECRET_KEY

AWS_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
             "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE")


@pytest.fixture
def no_aws_env(monkeypatch):
    for name in AWS_NAMES:
        monkeypatch.delenv(name, raising=False)


def set_connection(monkeypatch, conn_id: str, **fields) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps({"conn_type": "aws", **fields}))


def test_a_connection_gives_keys_endpoint_region_and_token(no_aws_env, monkeypatch):
    set_connection(monkeypatch, "store", login="key-id", password="secret-key",
                   extra={"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1",
                          "aws_session_token": "session-token", "unrelated": "left out"})
    assert storage_env("store") == {"AWS_ACCESS_KEY_ID": "key-id", "AWS_SECRET_ACCESS_KEY": "secret-key",
                                     "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-1",
                                     "AWS_SESSION_TOKEN": "session-token"}


def test_empty_connection_fields_set_no_variable(no_aws_env, monkeypatch):
    set_connection(monkeypatch, "keys_only", login="key-id", password="secret-key", extra={"endpoint_url": ""})
    assert storage_env("keys_only") == {"AWS_ACCESS_KEY_ID": "key-id", "AWS_SECRET_ACCESS_KEY": "secret-key"}


def test_without_a_connection_the_environment_s_own_variables_are_passed_on(no_aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "from-env")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")
    monkeypatch.setenv("UNRELATED", "x")
    assert storage_env("") == {"AWS_ACCESS_KEY_ID": "from-env"}


def test_a_missing_connection_is_an_error_not_empty_credentials(no_aws_env):
    with pytest.raises(AirflowNotFoundException, match="no_such_connection"):
        storage_env("no_such_connection")


def test_a_connection_of_another_type_is_refused_naming_setting_type_and_variable(no_aws_env, monkeypatch):
    """The review's reproduction: the metadata database's login and password became AWS keys."""
    monkeypatch.setenv("AIRFLOW_CONN_METADATA_DB", json.dumps(
        {"conn_type": "postgres", "host": "db", "login": "airflow", "password": "db-secret-pw"}))
    with pytest.raises(ConfigError) as refusal:
        storage_env("metadata_db")
    message = str(refusal.value)
    assert "Setting 'storage_conn_id' = 'metadata_db' names a connection of type 'postgres'" in message
    assert "of type 'aws'" in message and "GPT_FINETUNE_STORAGE_CONN_IDS" in message
    assert "db-secret-pw" not in message and "airflow" not in message


def test_applied_env_restores_the_environment_even_when_the_block_fails(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "before")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    with pytest.raises(RuntimeError), applied_env({"AWS_DEFAULT_REGION": "during", "AWS_ACCESS_KEY_ID": "k"}) as env:
        assert os.environ["AWS_DEFAULT_REGION"] == "during" and os.environ["AWS_ACCESS_KEY_ID"] == "k"
        assert env == {"AWS_DEFAULT_REGION": "during", "AWS_ACCESS_KEY_ID": "k"}
        raise RuntimeError("the task failed")
    assert os.environ["AWS_DEFAULT_REGION"] == "before"
    assert "AWS_ACCESS_KEY_ID" not in os.environ


@pytest.mark.parametrize(("settings", "conn_id"), [
    ({"storage_conn_id": "raw_params"}, "raw_params"),
    ({"config": {"storage_conn_id": "prepared"}, "storage_conn_id": "ignored"}, "prepared"),
    ({"config": "not a mapping", "storage_conn_id": "raw"}, "raw"),
    ({"storage_conn_id": 7}, ""),  # a refused run's setting: release still runs, on the environment's credentials
    ({}, ""),
])
def test_the_run_storage_connection_is_read_from_params_or_prepared_run(settings, conn_id):
    assert run_storage_conn_id(settings) == conn_id


def test_task_logic_reaches_s3_with_the_connection_only_inside_the_task(s3_endpoint, s3_bucket, no_aws_env,
                                                                        monkeypatch):
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_CONN_IDS", "run_store")
    set_connection(monkeypatch, "run_store", login=ACCESS_KEY, password=SECRET_KEY,
                   extra={"endpoint_url": s3_endpoint, "region_name": "us-east-1"})
    url = f"{s3_bucket}/runs/r1/state.json"

    @uses_run_storage
    def record_state(settings, payload: bytes, *, also: str) -> bytes:
        """The task logic."""
        assert os.environ["AWS_ENDPOINT_URL"] == s3_endpoint
        write_bytes_atomic(url, payload + also.encode())
        return read_bytes(url)

    assert record_state({"config": {"storage_conn_id": "run_store"}}, b"state", also="!") == b"state!"
    assert record_state.__name__ == "record_state" and record_state.__doc__ == "The task logic."
    assert not any(name in os.environ for name in AWS_NAMES), "the credentials outlived the task logic"


@pytest.mark.parametrize("allowed_ids, conn_type", [("run_storage", "aws"), ("run_storage,other_team", "postgres")])
def test_a_refused_run_connection_is_never_used_the_task_runs_on_the_environment_s_credentials(
        no_aws_env, monkeypatch, caplog, allowed_ids, conn_type):
    """A connection outside $GPT_FINETUNE_STORAGE_CONN_IDS, or of another type, never reaches the task (release must
    still run; prepare refuses the run by name): the environment's own credentials do, and the log says why."""
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_CONN_IDS", allowed_ids)
    monkeypatch.setenv("AIRFLOW_CONN_OTHER_TEAM", json.dumps(
        {"conn_type": conn_type, "login": "other-key", "password": "other-team-secret"}))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "deployment-key")

    @uses_run_storage
    def task_logic(settings):
        return os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")

    with caplog.at_level(logging.WARNING, logger="gpt_finetune.connections"):
        assert task_logic({"storage_conn_id": "other_team"}) == ("deployment-key", None)
    assert "'storage_conn_id' = 'other_team'" in caplog.text and "environment's credentials" in caplog.text
    assert "other-team-secret" not in caplog.text
