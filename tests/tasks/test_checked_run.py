"""A later task acts only on its own run's layout (issue 48 item 1, review t5 finding 1): every URL of the prepared
run's XCom is derived again from the task's own DAG run, and one that differs is refused by name before anything is
deleted, read or launched. The review's cases run through the real task functions with the XCom edited as it was."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import airflow  # noqa: F401 (its first import replaces the log handlers: here, not mid-test under caplog)
import pytest
from airflow.sdk.exceptions import AirflowFailException
from tf_multiworker.backends import make_backend

from core.layout import StorageLayout, run_key
from core.storage import exists, join
from tasks.baseline import plan_baseline
from tasks.checked_run import OwnRun, checked_run
from tasks.evaluate import evaluate_run
from tasks.promote import promote_run
from tests.tasks import run_fixtures


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "storage")


def test_the_prepared_run_as_publish_laid_it_out_passes_with_every_url_derived(root):
    prepared = run_fixtures.prepare_run(root, "manual__1")
    checked = checked_run(prepared, run_fixtures.own_run(prepared))
    storage = StorageLayout(root)
    assert checked.key == run_key(run_fixtures.DAG_ID, "manual__1") == prepared.run_key
    assert (checked.run, checked.manifest_url) == (storage.run(checked.key), prepared.manifest_url)
    assert (checked.train.url, checked.baseline.url, checked.run.report) == (
        prepared.train_url, prepared.baseline_url, prepared.report_url)


@pytest.mark.parametrize("field", ["config_url", "manifest_url", "train_url", "train_summary_url", "baseline_url",
                                   "baseline_config_url", "baseline_summary_url", "report_url"])
def test_a_url_edited_in_xcom_is_refused_naming_it_and_what_it_must_be(root, field):
    prepared = run_fixtures.prepare_run(root, "manual__1")
    edited = replace(prepared, **{field: "s3://elsewhere/x"})
    with pytest.raises(AirflowFailException) as refused:
        checked_run(edited, run_fixtures.own_run(prepared))
    message = str(refused.value)
    assert f"{field} = 's3://elsewhere/x' (it must be {getattr(prepared, field)!r})" in message
    assert "setting 'storage_root'" in message and "clear this run's tasks from 'prepare' on" in message


def test_another_run_s_prepared_run_is_refused_in_this_run(root):
    """The XCom copied from another run (or its run_id edited): this task's own DAG run decides the key."""
    other = run_fixtures.prepare_run(root, "manual__other")
    with pytest.raises(AirflowFailException, match=r"run_id = 'manual__other' \(it must be 'manual__mine'\); "
                                                   r"run_key = 'manual__other-[0-9a-f]+' \(it must be 'manual__mine-"):
        checked_run(other, OwnRun(run_fixtures.DAG_ID, "manual__mine"))


@pytest.mark.parametrize(("field", "value"), [
    ("dataset_fingerprint", "../../runs"), ("dataset_fingerprint", "3F2A9C01D4E5B6A7C8D9"),
    ("baseline_key", ".."), ("baseline_key", "gpt2-gb16-s40-0123456789abcdef/../../x"), ("baseline_key", ""),
])
def test_a_fingerprint_or_baseline_key_not_of_its_pattern_is_refused(root, field, value):
    prepared = run_fixtures.prepare_run(root, "manual__1")
    with pytest.raises(AirflowFailException, match=rf"The prepared run's {field} = {value!r} is not one: it must be"):
        checked_run(replace(prepared, **{field: value}), run_fixtures.own_run(prepared))


def test_plan_baseline_never_deletes_a_folder_that_xcom_names(root, tmp_path):
    """The review's reproduction: `baseline: run` and publish's `baseline_url` edited to a victim folder."""
    prepared = run_fixtures.prepare_run(root, "manual__victim", baseline="run")
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "important.txt").write_text("keep me")
    edited = replace(prepared, baseline_url=str(victim), baseline_summary_url=str(victim / "summary.json"))
    with pytest.raises(AirflowFailException, match=f"baseline_url = {str(victim)!r} \\(it must be "
                                                   f"{prepared.baseline_url!r}\\)"):
        plan_baseline(edited, run_fixtures.own_run(prepared))
    assert sorted(path.name for path in victim.iterdir()) == ["important.txt"]
    assert not exists(prepared.baseline_url)  # nothing written either: the check comes first


@pytest.mark.parametrize("field", ["train_url", "manifest_url", "report_url"])
def test_evaluate_fetches_and_launches_nothing_that_xcom_points_elsewhere(root, evaluations, internal_service, field):
    """The review's SSRF: train_url (or the manifest, or the report directory) = an internal HTTP service. Refused
    before any read, removal or launch: the service sees no request, no evaluation worker starts."""
    service, seen = internal_service
    prepared = run_fixtures.prepare_run(root, "manual__ssrf", baseline="skip")
    run_fixtures.write_training_output(prepared.train_url, num_workers=2, train_time_s=30.0, eval_loss=5.3)
    url = f"{service}/internal/{field}"
    edited = replace(prepared, **{field: url})
    with pytest.raises(AirflowFailException, match=f"{field} = {url!r} \\(it must be {getattr(prepared, field)!r}\\)"):
        evaluate_run(edited, run_fixtures.own_run(prepared), make_backend)
    assert seen == [] and evaluations() == []
    assert not exists(StorageLayout(root).run(prepared.run_key).state_file("evaluate-distributed"))


def test_promote_writes_no_verdict_where_xcom_points(root, tmp_path):
    """The review: promote wrote promotion.json under any report_url."""
    prepared = run_fixtures.prepare_run(root, "manual__elsewhere", baseline="skip")
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(AirflowFailException, match=f"report_url = {str(elsewhere)!r}"):
        promote_run(replace(prepared, report_url=str(elsewhere)), run_fixtures.own_run(prepared))
    assert not Path(elsewhere).exists() and not exists(join(prepared.report_url, "promotion.json"))
