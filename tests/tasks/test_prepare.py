"""The prepare stage's Airflow glue (prepare -> tokenize lanes -> publish): invalid settings fail without retries,
a large corpus is planned into lanes that travel as small dicts, and the prepared dict names every path."""

import hashlib
import json
import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException
from tf_multiworker.backends import make_backend

from core.config import RunConfig
from core.config.pinned import config_bytes, load_pinned_config
from core.layout import run_key
from core.protocol import CONFIG_SHA256_ENV, MANIFEST_SHA256_ENV
from tasks.dataset.plan import DatasetPlan
from tasks.dataset.records import LaneResult
from tasks.prepare import finish_run, plan_run, tokenize_lane
from tasks.prepared_run import PreparedRun
from trainer.data import load_manifest

RUN_ID = "manual__2026-11-29T02:00:00+00:00"
DAG_ID = "gpt_finetune"


def prepare_run(params: dict, run_id: str, dag_id: str) -> PreparedRun:
    """The three prepare tasks in a row, as the DAG runs them (XCom values through JSON), and the prepared run as
    a later task reads it."""
    planned = plan_run(params, run_id, dag_id, make_backend)
    plan = DatasetPlan.from_xcom(json.loads(json.dumps(planned.plan.to_xcom())))
    for lane in json.loads(json.dumps(planned.lanes_xcom())):
        assert LaneResult.from_xcom(json.loads(json.dumps(tokenize_lane(plan, lane).to_xcom()))).units
    return PreparedRun.from_xcom(json.loads(json.dumps(finish_run(plan, run_id, dag_id).to_xcom())))


def test_invalid_settings_fail_the_task_without_retries(tmp_path):
    with pytest.raises(AirflowFailException, match=r"Unknown run setting\(s\) \['num_wokers'\]"):
        prepare_run({"num_wokers": 2, "storage_root": str(tmp_path)}, RUN_ID, DAG_ID)
    assert not any(tmp_path.iterdir())  # nothing written


def test_settings_beyond_the_access_policy_fail_the_task_naming_the_setting(tmp_path):
    """The one check of the access policy (later tasks and the workers load the saved config without it)."""
    with pytest.raises(AirflowFailException, match=r"'dataset' = '/etc/\*.conf' is outside the allowed data roots"):
        prepare_run({"dataset": "/etc/*.conf", "storage_root": str(tmp_path)}, RUN_ID, DAG_ID)
    assert not any(tmp_path.iterdir())  # nothing written


def test_ssh_hosts_that_airflow_does_not_know_fail_the_task_before_tokenizing(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT_FINETUNE_SSH_CONN_IDS", "no_such_host,not_ssh")  # allowed, so the lookup refuses them
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
    # Loaded as the workers load them, pinned to the digests of the configurations the operators check
    # (core/config/pinned.py).
    checked = RunConfig.from_saved(prepared.config)
    run_cfg = load_pinned_config(prepared.config_url,
                                 {CONFIG_SHA256_ENV: hashlib.sha256(config_bytes(checked)).hexdigest()})
    baseline_cfg = load_pinned_config(prepared.baseline_config_url, {
        CONFIG_SHA256_ENV: hashlib.sha256(config_bytes(checked.baseline_config())).hexdigest()})
    assert run_cfg.max_steps == prepared.config["max_steps"] > 0  # derived from epochs, never 0 for the workers
    assert baseline_cfg.num_workers == 1 and baseline_cfg.global_batch_size == run_cfg.global_batch_size
    assert Path(prepared.manifest_url).exists()
    # The manifest is pinned too (review t5, finding 11): the digest of the bytes publish read, as the workers check.
    assert prepared.manifest_sha256 == hashlib.sha256(Path(prepared.manifest_url).read_bytes()).hexdigest()
    assert load_manifest(prepared.manifest_url, {MANIFEST_SHA256_ENV: prepared.manifest_sha256})["fingerprint"] == \
        prepared.dataset_fingerprint
    assert prepared.run_key == run_key(DAG_ID, RUN_ID)
    assert prepared.train_summary_url.startswith(prepared.train_url)
    assert prepared.baseline_summary_url.startswith(prepared.baseline_url)


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


def test_a_kubernetes_connection_that_airflow_does_not_know_fails_the_task_before_tokenizing(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT_FINETUNE_KUBERNETES_CONN_IDS", "no_such_cluster")
    settings = {"backend": "kubernetes", "storage_root": "s3://runs/root", "dataset": str(tmp_path / "absent.txt"),
                "kubernetes_conn_id": "no_such_cluster"}
    with pytest.raises(AirflowFailException, match=r"kubernetes_conn_id='no_such_cluster': no Airflow connection"):
        prepare_run(settings, RUN_ID, DAG_ID)


def test_a_corpus_in_several_lanes_travels_as_small_dicts_and_gives_the_same_dataset(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    paragraph = " ".join(["word"] * 120)
    for index in range(3):
        (corpus / f"part-{index}.txt").write_text("\n\n".join(f"{index} {i} {paragraph}" for i in range(3000)))
    params = {"storage_root": str(tmp_path / "root"), "dataset": str(corpus / "*.txt"), "tokenizer": "bpe:512",
              "block_size": 32, "baseline": "skip"}
    planned = plan_run({**params, "prepare_tasks": 3, "prepare_unit_mb": 1}, RUN_ID, DAG_ID, make_backend)
    assert len(planned.lanes) == 3 and planned.plan.dataset is None
    lanes = planned.lanes_xcom()
    assert len(json.dumps(planned.plan.to_xcom())) < 4000 and len(json.dumps(lanes)) < 2000
    assert set(lanes[0][0]) == {"index", "parts"} and set(lanes[0][0]["parts"][0]) == {"file", "start", "end", "bytes"}
    fanned = prepare_run({**params, "prepare_tasks": 3, "prepare_unit_mb": 1}, RUN_ID, DAG_ID)
    single = prepare_run({**params, "storage_root": str(tmp_path / "single"), "prepare_tasks": 1}, RUN_ID, DAG_ID)
    assert fanned.dataset_fingerprint == single.dataset_fingerprint
    assert fanned.config["max_steps"] == single.config["max_steps"]


@pytest.mark.parametrize("setting, value, variable", [
    ("image", "attacker.example/evil:latest", "GPT_FINETUNE_IMAGE_PREFIXES"),
    ("namespace", "attacker-team", "GPT_FINETUNE_NAMESPACES"),
    ("storage_conn_id", "metadata_db", "GPT_FINETUNE_STORAGE_CONN_IDS"),
])
def test_a_trigger_outside_the_allow_lists_is_refused_in_prepare_and_nothing_is_launched(
        s3_env, s3_bucket, monkeypatch, setting, value, variable):
    """The review's reproduction through the prepare task itself: refused by name, no backend made, nothing in the
    run's storage. The connection exists, an aws one of another system."""
    import boto3

    monkeypatch.setenv("AIRFLOW_CONN_METADATA_DB", json.dumps(
        {"conn_type": "aws", "login": "db-user", "password": "db-secret-pw"}))
    made = []

    def recording_backend(cfg, name=None):
        made.append(name or cfg.launch.backend)
        return make_backend(cfg, name)

    params = {"backend": "kubernetes", "storage_root": f"{s3_bucket}/gpt", setting: value}
    with pytest.raises(AirflowFailException, match=rf"Setting '{setting}' = '{value}' is outside the .*\({variable}="):
        plan_run(params, RUN_ID, DAG_ID, recording_backend)
    assert made == []
    assert boto3.client("s3", endpoint_url=s3_env).list_objects_v2(Bucket=s3_bucket[len("s3://"):])["KeyCount"] == 0


def test_a_storage_connection_of_another_type_is_refused_in_prepare_naming_its_type(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_CONN_IDS", "metadata_db")  # allowed by name, but not an aws connection
    monkeypatch.setenv("AIRFLOW_CONN_METADATA_DB", json.dumps(
        {"conn_type": "postgres", "host": "db", "login": "airflow", "password": "db-secret-pw"}))
    with pytest.raises(AirflowFailException) as refusal:
        plan_run({"storage_root": str(tmp_path), "storage_conn_id": "metadata_db"}, RUN_ID, DAG_ID, make_backend)
    assert "Setting 'storage_conn_id' = 'metadata_db' names a connection of type 'postgres'" in str(refusal.value)
    assert "db-secret-pw" not in str(refusal.value)
    assert not any(tmp_path.iterdir())  # nothing written
