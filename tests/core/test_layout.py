"""Run keys: one per DAG run, safe in paths and S3 keys, never shared by two runs."""

import subprocess
import sys

import pytest

from core.layout import run_key
from core.protocol import RUN_KEY_ENV, RUN_KEY_PATTERN
from tasks.release import processes_of_run

# Both are valid Airflow run ids (default pattern ^[A-Za-z0-9_.~:+-]+$) and sanitize to the same text.
SCHEDULED = "manual__2026-11-29T15:00:00+00:00"
LOOKALIKE = "manual__2026-11-29T15_00_00_00_00"


def test_run_ids_that_sanitize_alike_get_different_keys():
    assert run_key("gpt_finetune", SCHEDULED) != run_key("gpt_finetune", LOOKALIKE)
    assert run_key("gpt_finetune", SCHEDULED).startswith("manual__2026-11-29T15_00_00_00_00-")


def test_the_same_run_id_in_another_dag_gets_another_key():
    assert run_key("gpt_finetune", SCHEDULED) != run_key("other_dag", SCHEDULED)


def test_keys_are_stable_and_safe_in_paths():
    for run_id in (SCHEDULED, LOOKALIKE, "..", "~~", "a/../../b", "x" * 300, ".hidden"):
        key = run_key("gpt_finetune", run_id)
        assert key == run_key("gpt_finetune", run_id)
        assert RUN_KEY_PATTERN.fullmatch(key), key  # what the SSH agent and the reports app accept
    with pytest.raises(ValueError):
        run_key("gpt_finetune", "")


@pytest.mark.parametrize("text", [".", "..", ".hidden", "a/b", "../etc", "a\nb", "a b", "", "x" * 201, "ключ"])
def test_the_run_key_pattern_refuses_what_is_not_one_directory_name(text):
    assert RUN_KEY_PATTERN.fullmatch(text) is None


def test_releasing_one_run_finds_only_its_own_workers():
    """Release finds a run's processes by the key in their environment: a look-alike run's workers are not its."""
    keys = [run_key("gpt_finetune", SCHEDULED), run_key("gpt_finetune", LOOKALIKE)]
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env={RUN_KEY_ENV: key})
               for key in keys]
    try:
        assert set(processes_of_run(keys[0])) == {workers[0].pid}
        assert set(processes_of_run(keys[1])) == {workers[1].pid}
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def test_relative_storage_roots_are_from_the_repository_whatever_the_cwd(tmp_path, monkeypatch):
    from core.layout import REPO_ROOT, absolute_root

    monkeypatch.chdir(tmp_path)
    assert absolute_root("storage") == str(REPO_ROOT / "storage")
    assert absolute_root("s3://bucket/root/") == "s3://bucket/root"
    assert absolute_root(str(tmp_path / "x")) == str(tmp_path / "x")


def test_the_preflight_output_is_asked_of_the_layout():
    from core.layout import StorageLayout

    preflight = StorageLayout("s3://b/root").run("k").preflight
    assert (preflight.result, preflight.rank_report(3)) == (
        "s3://b/root/runs/k/report/preflight.json", "s3://b/root/runs/k/report/preflight/rank-3.json")
