"""The prepare task's glue: invalid settings fail without retries; the prepared dict names every path."""

import json
import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from tasks.prepare import prepare_run
from trainer.config import RunConfig
from trainer.layout import run_key

RUN_ID = "manual__2026-11-29T02:00:00+00:00"
DAG_ID = "gpt_finetune"


def test_invalid_settings_fail_the_task_without_retries(tmp_path):
    with pytest.raises(AirflowFailException, match=r"Unknown run setting\(s\) \['num_wokers'\]"):
        prepare_run({"num_wokers": 2, "storage_root": str(tmp_path)}, RUN_ID, DAG_ID)
    assert not any(tmp_path.iterdir())  # nothing written


def test_ssh_hosts_that_airflow_does_not_know_fail_the_task_before_tokenizing(tmp_path, monkeypatch):
    monkeypatch.setenv("AIRFLOW_CONN_NOT_SSH", '{"conn_type": "http", "host": "example.invalid"}')
    settings = {"backend": "ssh", "storage_root": "s3://runs/root", "dataset": str(tmp_path / "absent.txt")}
    with pytest.raises(AirflowFailException, match=r"'ssh_conn_ids' names 'no_such_host', which is no Airflow"):
        prepare_run({**settings, "ssh_conn_ids": ["no_such_host"]}, RUN_ID, DAG_ID)
    with pytest.raises(AirflowFailException, match=r"'not_ssh', a connection of type 'http'"):
        prepare_run({**settings, "ssh_conn_ids": ["not_ssh"]}, RUN_ID, DAG_ID)


def test_prepared_run_lists_configs_with_resolved_steps(tmp_path):
    params = {"storage_root": str(tmp_path), "num_workers": 2, "tokenizer": "bpe:512", "block_size": 32,
              "max_steps": 0, "warmup_steps": 0, "epochs": 1.0, "baseline": "skip"}
    prepared = prepare_run(params, RUN_ID, DAG_ID)
    run_cfg = RunConfig.from_params(json.loads(Path(prepared["config_url"]).read_text()))
    baseline_cfg = RunConfig.from_params(json.loads(Path(prepared["baseline_config_url"]).read_text()))
    assert run_cfg.max_steps == prepared["total_steps"] > 0  # derived from epochs, never 0 for the workers
    assert baseline_cfg.num_workers == 1 and baseline_cfg.global_batch_size == run_cfg.global_batch_size
    assert Path(prepared["manifest_url"]).exists()
    assert prepared["run_key"] == run_key(DAG_ID, RUN_ID)
    assert prepared["train_summary_url"].startswith(prepared["train_url"])
    assert prepared["baseline_summary_url"].startswith(prepared["baseline_url"])


@pytest.mark.parametrize("model, name", [("promoted", "gpt_finetune"), ("promoted:nightly-chat", "nightly-chat")])
def test_continuing_from_a_model_never_promoted_fails_at_once_naming_setting_and_path(tmp_path, model, name):
    started = time.monotonic()
    with pytest.raises(AirflowFailException) as failure:
        prepare_run({"storage_root": str(tmp_path), "model": model}, RUN_ID, DAG_ID)
    assert time.monotonic() - started < 5  # before any tokenizing
    message = str(failure.value)
    assert f"Setting 'model' = '{model}'" in message
    assert f"{tmp_path}/models/{name}/latest.json is missing" in message
    assert not (tmp_path / "datasets").exists()


def test_a_kubernetes_connection_that_airflow_does_not_know_fails_the_task_before_tokenizing(tmp_path):
    settings = {"backend": "kubernetes", "storage_root": "s3://runs/root", "dataset": str(tmp_path / "absent.txt"),
                "kubernetes_conn_id": "no_such_cluster"}
    with pytest.raises(AirflowFailException, match=r"kubernetes_conn_id='no_such_cluster': no Airflow connection"):
        prepare_run(settings, RUN_ID, DAG_ID)
