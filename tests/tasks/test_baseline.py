"""The baseline key (what makes two baselines interchangeable) and the auto / run / skip policy."""

import logging
import shutil
from dataclasses import replace

import pytest

from core.config import RunConfig
from core.layout import TrainOutput
from core.storage import exists, read_json
from tasks import baseline as baseline_module
from tasks.baseline import baseline_key, plan_baseline, read_key_record
from tests.tasks import run_fixtures

VALIDATION = {"sequences": 10_000, "tokens": 640_000, "shards": [
    {"name": "validation-00000-of-00001.tfrecord", "sequences": 10_000, "sha256": "0" * 64}]}
MANIFEST = {"fingerprint": "ds-1", "tokenizer": {"fingerprint": "tok-1"}, "block_size": 64, "sequences_per_record": 512,
            "splits": {"validation": VALIDATION}}
BASE = RunConfig(num_workers=2, max_steps=40)


def key(cfg=BASE, manifest=MANIFEST, steps=40):
    return baseline_key(cfg, manifest, steps)


def test_key_is_stable_and_ignores_what_cannot_change_the_result():
    assert key() == key(RunConfig(num_workers=2, max_steps=40))
    # Same global batch on a different worker count: the baseline (1 worker, accumulation x N) is the same job.
    assert key(BASE.replace(num_workers=1, grad_accum_steps=2)) == key()
    assert key(BASE.replace(num_workers=4, batch_size_per_worker=4)) != key()  # 4x4: accumulation 4 of 4
    assert key(BASE.replace(num_workers=4, batch_size_per_worker=4)) == key(
        BASE.replace(num_workers=1, batch_size_per_worker=4, grad_accum_steps=4))
    for setting in ({"storage_root": "s3://other/root"}, {"baseline": "run"}, {"loss_tolerance": 0.5},
                    {"startup_timeout_s": 30}, {"hang_timeout_s": 60}, {"checkpoint_every_steps": 7},
                    {"communication": "ring"}, {"storage_conn_id": "minio"}, {"model_name": "chat"},
                    {"promotion_tolerance": 0.1}, {"promote": "never"}):
        assert key(BASE.replace(**setting)) == key(), setting


@pytest.mark.parametrize("change", [
    {"model": "gpt2-124m"}, {"learning_rate": 2e-3}, {"warmup_steps": 3}, {"weight_decay": 0.1},
    {"batch_size_per_worker": 4}, {"grad_accum_steps": 2}, {"block_size": 128}, {"seed": 7},
    {"mixed_precision": "bf16"}, {"xla": True}, {"use_gpu": True},
])
def test_every_setting_that_changes_the_result_changes_the_key(change):
    assert key(BASE.replace(**change)) != key()


def test_data_steps_and_code_change_the_key(tmp_path, monkeypatch):
    assert key(manifest={**MANIFEST, "fingerprint": "ds-2"}) != key()
    assert key(manifest={**MANIFEST, "tokenizer": {"fingerprint": "tok-2"}}) != key()
    assert key(steps=41) != key()
    # The evaluation sample: its size, and the validation shards it is drawn from (a cached eval.json scored it).
    assert key(BASE.replace(eval_tokens=64_000)) != key()
    assert key(BASE.replace(eval_tokens=0)) == key(BASE.replace(eval_tokens=10**9))  # both the whole split
    shard = {**VALIDATION["shards"][0], "sha256": "1" * 64}
    assert key(manifest={**MANIFEST, "splits": {"validation": {**VALIDATION, "shards": [shard]}}}) != key()

    copies = {folder: tmp_path / folder for folder in baseline_module.WORKER_SOURCES}
    for folder, copy in copies.items():
        shutil.copytree(baseline_module.WORKER_SOURCES[folder], copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(baseline_module, "WORKER_SOURCES", copies)
    for changed in (copies["core"] / "config" / "core.py", copies["trainer"] / "train.py"):
        before = key()
        changed.write_text(changed.read_text() + "\n# changed\n")
        assert key() != before, changed


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "storage")


def test_skip_never_trains(root):
    prepared = run_fixtures.prepare_run(root, "manual__1", baseline="skip")
    assert plan_baseline(prepared, run_fixtures.own_run(prepared)) is False
    assert not exists(prepared.baseline_url)


def test_auto_trains_once_then_reuses_the_matching_baseline(root, caplog):
    caplog.set_level(logging.INFO, logger="gpt_finetune.baseline")
    first = run_fixtures.prepare_run(root, "scheduled__1")
    assert plan_baseline(first, run_fixtures.own_run(first)) is True
    assert read_key_record(first.baseline_url).trained_by_run == "scheduled__1"
    run_fixtures.write_training_output(first.baseline_url, num_workers=1, train_time_s=20.0, eval_loss=5.3)

    # The next night: other workers and timeouts, same global batch -> the same baseline, not trained again.
    second = run_fixtures.prepare_run(root, "scheduled__2", num_workers=1, grad_accum_steps=2, hang_timeout_s=99)
    assert second.baseline_key == first.baseline_key
    summary_before = read_json(second.baseline_summary_url)
    assert plan_baseline(second, run_fixtures.own_run(second)) is False
    assert read_json(second.baseline_summary_url) == summary_before
    assert "reusing baseline" in caplog.text

    # A key part changes -> a new baseline, and the log names what changed against the latest complete one.
    third = run_fixtures.prepare_run(root, "scheduled__3", learning_rate=2e-3)
    assert third.baseline_key != first.baseline_key
    assert plan_baseline(third, run_fixtures.own_run(third)) is True
    assert "learning_rate (0.003 -> 0.002)" in caplog.text
    assert exists(first.baseline_url + "/summary.json")  # the old baseline stays for runs that match it


def test_auto_resumes_an_interrupted_baseline(root, caplog):
    caplog.set_level(logging.INFO, logger="gpt_finetune.baseline")
    prepared = run_fixtures.prepare_run(root, "manual__1")
    output = run_fixtures.write_training_output(prepared.baseline_url, num_workers=1, train_time_s=20.0,
                                                eval_loss=5.3, complete=False)
    assert plan_baseline(prepared, run_fixtures.own_run(prepared)) is True
    assert exists(output.checkpoints)  # kept: the trainer resumes from them
    assert "without summary.json" in caplog.text


def test_run_clears_the_old_baseline_so_its_summary_cannot_pass_for_the_new_one(root):
    prepared = run_fixtures.prepare_run(root, "manual__1", baseline="run")
    output = run_fixtures.write_training_output(prepared.baseline_url, num_workers=1, train_time_s=20.0,
                                                eval_loss=5.3)
    assert plan_baseline(prepared, run_fixtures.own_run(prepared)) is True
    assert not exists(output.summary) and not exists(output.checkpoints)
    assert read_key_record(prepared.baseline_url).key == prepared.baseline_key


def test_a_key_that_no_longer_matches_the_settings_is_refused(root):
    prepared = run_fixtures.prepare_run(root, "manual__1")
    prepared = replace(prepared, config={**prepared.config, "seed": 99})  # changed behind the prepare task's back
    with pytest.raises(RuntimeError, match=prepared.baseline_key):
        plan_baseline(prepared, run_fixtures.own_run(prepared))
    assert not exists(TrainOutput(prepared.baseline_url).url)


def test_key_records_of_earlier_runs_still_explain_and_a_mistyped_one_is_refused_by_name(root, caplog):
    """A key record of key format 1 (no eval_sample) is compared like any; one of another shape is refused, naming
    the file and the field, and left out of the explanation."""
    from core.document import DocumentError
    from core.storage import write_json_atomic

    caplog.set_level(logging.INFO, logger="gpt_finetune.baseline")
    first = run_fixtures.prepare_run(root, "scheduled__1")
    plan_baseline(first, run_fixtures.own_run(first))
    run_fixtures.write_training_output(first.baseline_url, num_workers=1, train_time_s=20.0, eval_loss=5.3)
    record = read_json(f"{first.baseline_url}/baseline_key.json")
    assert read_key_record(first.baseline_url).to_json() == record  # the file's keys and values, read back
    assert read_key_record(first.baseline_url).parts.eval_sample == record["parts"]["eval_sample"]
    older = {k: v for k, v in record["parts"].items() if k != "eval_sample"} | {"key_format_version": 1}
    write_json_atomic(f"{first.baseline_url}/baseline_key.json", {**record, "parts": older})
    assert read_key_record(first.baseline_url).parts.to_json() == older

    second = run_fixtures.prepare_run(root, "scheduled__2", learning_rate=2e-3)
    assert plan_baseline(second, run_fixtures.own_run(second)) is True
    assert "key_format_version (1 -> 2), eval_sample (None -> " in caplog.text and "learning_rate" in caplog.text

    write_json_atomic(f"{first.baseline_url}/baseline_key.json", {**record, "parts": {**older, "steps": "40"}})
    with pytest.raises(DocumentError, match=r"baseline_key.json: parts.steps: expected int, got str"):
        read_key_record(first.baseline_url)
    caplog.clear()
    third = run_fixtures.prepare_run(root, "scheduled__3", learning_rate=1e-3)
    assert plan_baseline(third, run_fixtures.own_run(third)) is True
    assert "is not compared:" in caplog.text and "no complete baseline exists yet" in caplog.text


def test_a_baseline_summary_of_another_shape_is_refused_before_it_is_reused(root):
    from core.storage import write_json_atomic
    from core.summary import SummaryError

    prepared = run_fixtures.prepare_run(root, "manual__1")
    run_fixtures.write_training_output(prepared.baseline_url, num_workers=1, train_time_s=20.0, eval_loss=5.3)
    summary = read_json(prepared.baseline_summary_url)
    write_json_atomic(prepared.baseline_summary_url, {**summary, "train_time_s": "20 s"})
    with pytest.raises(SummaryError, match=r"summary.json: train_time_s: expected float"):
        plan_baseline(prepared, run_fixtures.own_run(prepared))
