"""What tokenize and publish read back from XCom and storage is checked before use (issue 37 item 1, review
finding 3): only ids from XCom, the plan from the run's own storage root, its sources held to the access policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException
from tf_multiworker.backends import make_backend

from core.config import ConfigError, RunConfig
from core.config.access import AccessPolicy
from core.document import DocumentError
from tasks.dataset.errors import PrepareError
from tasks.dataset.plan import DatasetPlan
from tasks.prepare import finish_run, plan_run, tokenize_lane
from tests.tasks.dataset.corpus import two_part_corpus

RUN_ID = "manual__2026-12-04T21:00:00+00:00"
DAG_ID = "gpt_finetune"


@pytest.fixture
def planned(tmp_path, monkeypatch):
    """A corpus planned in two lanes under a data root; the secret lies outside every data root."""
    root = tmp_path / "allowed"
    corpus = two_part_corpus(root / "corpus")
    monkeypatch.setenv("GPT_FINETUNE_DATA_ROOTS", str(root))
    secret = tmp_path / "outside-every-data-root.txt"
    secret.write_text("db_password = hunter2\n" * 50)
    params = {"storage_root": str(root / "storage"), "dataset": str(corpus / "*.txt"), "tokenizer": "bpe:300",
              "block_size": 32, "baseline": "skip", "prepare_tasks": 2, "prepare_unit_mb": 1}
    planned = plan_run(params, RUN_ID, DAG_ID, make_backend)
    result = json.loads(json.dumps({"plan": planned.plan.to_xcom(), "lanes": planned.lanes_xcom()}))  # as XCom
    assert len(result["lanes"]) == 2
    return result, secret


def plan_file(plan: dict) -> Path:
    return Path(plan["plan_url"])


def test_a_plan_in_xcom_is_ignored_the_plan_is_read_from_its_place(planned):
    """The review's reproduction: an XCom plan with a `job` naming a file outside every data root was tokenized."""
    result, secret = planned
    crafted = {**result["plan"], "job": {"work_url": "/tmp/x", "sources": [{"url": str(secret)}]},
               "plan_url": str(secret)}
    with pytest.raises(DocumentError, match=r"DatasetPlan: unknown key\(s\) job"):
        DatasetPlan.from_xcom(crafted)  # the dataset plan holds ids, never a job
    del crafted["job"]
    done = tokenize_lane(DatasetPlan.from_xcom(crafted), result["lanes"][0])
    assert list(done.units) == [unit["index"] for unit in result["lanes"][0]]
    assert not Path("/tmp/x").exists() or not any(Path("/tmp/x").glob("*.bin"))


@pytest.mark.parametrize("change, message", [
    (lambda plan, secret: plan["job"]["sources"].__setitem__(0, {**plan["job"]["sources"][0], "url": str(secret)}),
     "which the access policy does not let this run read"),
    (lambda plan, secret: plan["job"]["sources"].__setitem__(0, {**plan["job"]["sources"][0],
                                                                 "url": "http://169.254.169.254/latest/"}),
     "which the access policy does not let this run read"),
    (lambda plan, secret: plan["job"].update(work_url=str(secret.parent / "elsewhere")), r"job\.work_url"),
    (lambda plan, secret: plan["job"].update(tokenizer_dir=str(secret.parent)), r"job\.tokenizer_dir"),
    (lambda plan, secret: plan.update(fingerprint="0" * 20), "fingerprint"),
])
def test_a_plan_rewritten_in_storage_is_refused_before_anything_is_read(planned, change, message):
    result, secret = planned
    path = plan_file(result["plan"])
    plan = json.loads(path.read_text())
    change(plan, secret)
    path.write_text(json.dumps(plan))
    with pytest.raises(PrepareError, match=message):
        tokenize_lane(DatasetPlan.from_xcom(result["plan"]), result["lanes"][0])
    with pytest.raises(PrepareError, match=message):
        finish_run(DatasetPlan.from_xcom(result["plan"]), RUN_ID, DAG_ID)


@pytest.mark.parametrize("change, field", [
    (lambda plan: plan["job"].update(seed="1234"), r"WorkPlan\.job: UnitJob\.seed: expected int, got str '1234'"),
    (lambda plan: plan["job"]["sources"][0].update(size=None),
     r"WorkPlan\.job: UnitJob\.sources\[0\]: SourceFile\.size: expected int, got NoneType"),
    (lambda plan: plan["settings"].update(block_size=32.0),
     r"WorkPlan\.settings: PackingSettings\.block_size: expected int"),
    (lambda plan: plan.update(config={}), r"WorkPlan: unknown key\(s\) config"),
    (lambda plan: plan.pop("units"), r"WorkPlan: missing key\(s\) units"),
])
def test_a_plan_of_another_shape_in_storage_is_refused_naming_the_file_and_field(planned, change, field):
    result, _ = planned
    path = plan_file(result["plan"])
    plan = json.loads(path.read_text())
    change(plan)
    path.write_text(json.dumps(plan))
    for task in (lambda: tokenize_lane(DatasetPlan.from_xcom(result["plan"]), result["lanes"][0]),
                 lambda: finish_run(DatasetPlan.from_xcom(result["plan"]), RUN_ID, DAG_ID)):
        with pytest.raises(PrepareError, match=rf"The plan {path} is refused: {field}"):
            task()


@pytest.mark.parametrize("ids, message", [
    ({"fingerprint": "../../x"}, "fingerprint '../../x' is not one"),
    ({"plan_id": "../x"}, "plan's id '../x' is not one"),
    ({"plan_id": "0123456789ab"}, "cannot be read"),
])
def test_ids_from_xcom_name_only_a_plan_under_the_storage_root(planned, ids, message):
    result, _ = planned
    with pytest.raises(PrepareError, match=message):
        tokenize_lane(DatasetPlan.from_xcom({**result["plan"], **ids}), result["lanes"][0])


@pytest.mark.parametrize("unit", [
    {"index": 0, "parts": [{"file": 0, "start": 0, "end": 1 << 40, "bytes": 1}]},
    {"index": 0, "parts": [{"file": 7, "start": 0, "end": 1, "bytes": 1}]},
    {"index": 99, "parts": []},
    {"index": "0", "parts": []},
    {"index": 0, "parts": [{"file": 0, "start": 0, "end": 1, "bytes": 1, "url": "/etc/passwd"}]},
])
def test_a_lane_with_units_outside_the_plan_is_refused(planned, unit):
    result, _ = planned
    with pytest.raises(PrepareError, match="lane"):
        tokenize_lane(DatasetPlan.from_xcom(result["plan"]), [unit])


@pytest.mark.parametrize("lane, field", [
    ([{"index": "0", "parts": []}], r"Unit\.index: expected int, got str '0'"),
    ([{"index": 0, "parts": [{"file": 0, "start": "0", "end": 1, "bytes": 1}]}], r"Part\.start: expected int"),
    ([{"index": 0, "parts": [{"file": 0, "start": 0, "end": 1, "bytes": True}]}], r"Part\.bytes: expected int"),
    ([{"index": 0}], r"Unit: missing key\(s\) parts"),
    ({"index": 0, "parts": []}, "lane is not a list of units"),
])
def test_a_mistyped_unit_of_a_lane_is_refused_naming_the_field(planned, lane, field):
    result, _ = planned
    with pytest.raises(PrepareError, match=field):
        tokenize_lane(DatasetPlan.from_xcom(result["plan"]), lane)


def test_a_config_rewritten_in_xcom_is_held_to_the_policy_again(planned):
    result, _ = planned
    for setting, value in (("model", "http://169.254.169.254/latest/"), ("dataset", "/etc/*.txt"),
                           ("storage_root", "/")):
        crafted = {**result["plan"], "config": {**result["plan"]["config"], setting: value}}
        with pytest.raises(AirflowFailException, match=f"configuration is refused: Setting '{setting}'"):
            tokenize_lane(DatasetPlan.from_xcom(crafted), result["lanes"][0])
        with pytest.raises(AirflowFailException, match=f"Setting '{setting}'"):
            finish_run(DatasetPlan.from_xcom(crafted), RUN_ID, DAG_ID)


def test_a_prepared_dataset_in_xcom_must_lie_where_its_fingerprint_says(planned, tmp_path):
    result, _ = planned
    for lane in result["lanes"]:
        tokenize_lane(DatasetPlan.from_xcom(result["plan"]), lane)
    prepared = finish_run(DatasetPlan.from_xcom(result["plan"]), RUN_ID, DAG_ID)
    dataset = {"manifest_url": str(tmp_path / "elsewhere" / "manifest.json"), "fingerprint": "../elsewhere",
               "cache_hit": True, "train_sequences": 1, "validation_sequences": 1, "train_tokens": 1,
               "tokenized_tokens": 0, "elapsed_s": 0.0, "timings": {}, "source_bytes_read": 0}
    with pytest.raises(PrepareError, match="is not where its fingerprint"):
        finish_run(DatasetPlan.from_xcom({**result["plan"], "dataset": dataset}), RUN_ID, DAG_ID)
    assert prepared.dataset_fingerprint == result["plan"]["fingerprint"]


def test_from_saved_holds_a_config_to_the_policy_it_is_given():
    """The review's reproduction: `from_saved` accepted http://169.254.169.254/ as a model."""
    saved = {"model": "http://169.254.169.254/latest/", "dataset": "/etc/*.txt"}
    assert RunConfig.from_saved(saved).model == "http://169.254.169.254/latest/"  # a worker: no policy there
    with pytest.raises(ConfigError, match="'dataset' = '/etc/\\*.txt' is outside the allowed data roots"):
        RunConfig.from_saved(saved, policy=AccessPolicy.from_env())
    with pytest.raises(ConfigError, match="'model' = 'http://169.254.169.254/latest/' uses the scheme 'http'"):
        RunConfig.from_saved({"model": "http://169.254.169.254/latest/"}, policy=AccessPolicy.from_env())

