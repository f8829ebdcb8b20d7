"""The whole pipeline as a user runs it: the README's main command, triggered runs on a real scheduler, a worker
SIGKILLed mid-training (with and without a successful retry), and a run killed from outside.

Small settings keep each run to about a minute on 2 cores; everything else is real: Airflow's scheduler with the
LocalExecutor, worker processes on loopback, shards and checkpoints in storage, and the release teardown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from tasks.release import processes_of_run
from tests.airflow_stack import REPO, airflow_env, free_port
from tests.hardware import assert_gpu_check_matches_this_machine, nvidia_gpus
from trainer.layout import StorageLayout, run_key

pytestmark = pytest.mark.timeout(900)

DAG = "gpt_finetune"
# No promotion: these runs test the pipeline, and a promoted version would be scored again by every later run
# (tests/e2e/test_promotion.py promotes).
FAST = {"num_workers": 2, "tokenizer": "bpe:512", "block_size": 32, "batch_size_per_worker": 4,
        "max_steps": 12, "warmup_steps": 2, "checkpoint_every_steps": 4, "startup_timeout_s": 240, "promote": "never"}
# Long enough that a checkpoint exists well before the end, short enough for CI.
LONG = {**FAST, "baseline": "skip", "max_steps": 300, "checkpoint_every_steps": 25}


def trigger(stack, conf: dict) -> str:
    stack.wait_for_dag(DAG)
    return stack.cli_json("dags", "trigger", DAG, "--conf", json.dumps(conf))[0]["dag_run_id"]


def storage(stack) -> StorageLayout:
    return StorageLayout(stack.env["GPT_FINETUNE_STORAGE_ROOT"])


def worker_ranks(key: str, module: str = "trainer.train") -> dict[int, int]:
    """rank -> pid of the live worker processes of run `key` running `module`."""
    ranks = {}
    for pid, cmdline in processes_of_run(key).items():
        if f"-m {module}" not in cmdline:
            continue
        try:
            environ = dict(item.split("=", 1) for item in
                           Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
        except (FileNotFoundError, ProcessLookupError):  # exited since the scan
            continue
        ranks[json.loads(environ["TF_CONFIG"])["task"]["index"]] = pid
    return ranks


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"not within {timeout:.0f}s: {what}")


def run_path(run_id: str) -> str:
    return f"/api/v2/dags/{DAG}/dagRuns/{urllib.parse.quote(run_id, safe='')}"


def assert_released(stack, run_id: str) -> dict:
    key = run_key(DAG, run_id)
    assert processes_of_run(key) == {}, "a process of the run outlived the release"
    release = json.loads(Path(storage(stack).run(key).release).read_text())
    assert release["clean"] is True
    assert_gpu_check_matches_this_machine(release["gpu_check"])
    return release


def test_readme_main_command_runs_the_whole_dag_on_s3(tmp_path):
    """`make demo-s3` in miniature: `airflow dags test` of the full chain with storage on a local S3 server."""
    env = airflow_env(tmp_path / "home", free_port(), {"GPT_FINETUNE_STORAGE_ROOT": str(tmp_path / "unused")})
    result = subprocess.run(
        [sys.executable, "scripts/demo.py", "--s3", "--conf", json.dumps({**FAST, "promote": "auto"})],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=800, check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    report_line = next(line for line in result.stdout.splitlines() if line.startswith("Report: "))
    assert report_line.startswith("Report: s3://gpt-finetune/gpt_finetune/runs/")
    assert "| distributed | 2 |" in result.stdout and "**Gates: PASSED**" in result.stdout
    assert "**Promoted** to gpt_finetune v1 (s3://gpt-finetune/gpt_finetune/models/gpt_finetune/v1)" in result.stdout
    assert "## Samples" in result.stdout and "| distributed | " in result.stdout.split("## Samples")[1]
    runs = subprocess.run([str(REPO / ".venv/bin/airflow"), "dags", "list-runs", DAG, "-o", "json"], env=env,
                          capture_output=True, text=True, check=True).stdout
    run_id = json.loads(next(line for line in runs.splitlines() if line.startswith("[{")))[0]["run_id"]
    states = subprocess.run([str(REPO / ".venv/bin/airflow"), "tasks", "states-for-dag-run", DAG, run_id, "-o",
                             "json"], env=env, capture_output=True, text=True, check=True).stdout
    by_task = {row["task_id"]: row["state"] for row in json.loads(next(
        line for line in states.splitlines() if line.startswith("[{")))}
    assert by_task == {**dict.fromkeys(["prepare", "publish", "preflight", "train", "plan_baseline", "baseline",
                                        "evaluate", "promote", "release", "outcome"], "success"),
                       "tokenize": "skipped"}  # the sample corpus is prepared in one task


def fan_out_corpus(directory: Path) -> Path:
    """Three files of about 0.85 MB (the sample plays, repeated): three 1 MB units, two lanes with prepare_tasks 2."""
    directory.mkdir(parents=True, exist_ok=True)
    for play in sorted((REPO / "data" / "sample").glob("*.txt")):
        (directory / play.name).write_text("\n\n".join([play.read_text(encoding="utf-8")] * 9), encoding="utf-8")
    return directory


def mapped_states(stack, run_id: str, task_id: str) -> list[str]:
    page = stack.rest("GET", f"{run_path(run_id)}/taskInstances?limit=100")
    return [row["state"] for row in page["task_instances"] if row["task_id"] == task_id]


def test_triggered_run_succeeds_and_the_next_nightly_run_reuses_shards_and_baseline(airflow_stack, tmp_path):
    """The first run tokenizes in two mapped tasks (prepare_tasks 2); the second finds the dataset cached."""
    conf = {**FAST, "dataset": str(fan_out_corpus(tmp_path / "corpus") / "*.txt"), "prepare_tasks": 2,
            "prepare_unit_mb": 1}
    first = trigger(airflow_stack, conf)
    assert airflow_stack.wait_for_run(DAG, first, timeout=600) == "success"
    states = airflow_stack.task_states(DAG, first)
    assert set(states.values()) == {"success"}, states
    assert mapped_states(airflow_stack, first, "tokenize") == ["success", "success"]
    assert "tokenizing in 2 mapped tasks (prepare_tasks=2)" in airflow_stack.task_log(DAG, first, "prepare")
    run = storage(airflow_stack).run(run_key(DAG, first))
    report = json.loads(Path(run.report, "report.json").read_text())
    assert report["gates_passed"] is True
    assert list(Path(storage(airflow_stack).root, "datasets").glob("*/manifest.json"))
    assert "cache hit" not in airflow_stack.task_log(DAG, first, "prepare")
    assert_released(airflow_stack, first)

    second = trigger(airflow_stack, conf)
    assert airflow_stack.wait_for_run(DAG, second, timeout=600) == "success"
    states = airflow_stack.task_states(DAG, second)
    assert states["baseline"] == "skipped", states  # reused, not retrained
    assert states["tokenize"] == "skipped", states
    assert "cache hit" in airflow_stack.task_log(DAG, second, "prepare")
    again = json.loads(Path(storage(airflow_stack).run(run_key(DAG, second)).report, "report.json").read_text())
    assert again["baseline"]["reused"] is True
    assert again["baseline"]["key"] == report["baseline"]["key"]
    assert_released(airflow_stack, second)


def test_sigkilled_worker_fails_the_attempt_and_the_retry_resumes_from_the_checkpoint(airflow_stack):
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    train = storage(airflow_stack).run(key).train
    wait_until(lambda: Path(train.checkpoints, "checkpoint").exists(), 400, "first checkpoint of attempt 1")
    ranks = wait_until(lambda: len(found := worker_ranks(key)) == 2 and found, 30, "both trainer workers")
    os.kill(ranks[1], signal.SIGKILL)

    assert airflow_stack.wait_for_run(DAG, run_id, timeout=600) == "success"
    first_attempt = airflow_stack.task_log(DAG, run_id, "train", try_number=1)
    assert "rank 1" in first_attempt and "SIGKILL" in first_attempt
    retry = airflow_stack.task_log(DAG, run_id, "train", try_number=2)
    assert "resuming" in retry
    summary = json.loads(Path(train.summary).read_text())
    assert summary["resumed_from_step"] >= LONG["checkpoint_every_steps"]
    assert summary["steps"] == LONG["max_steps"]
    assert_released(airflow_stack, run_id)


def task_runner_pid(stack, run_id: str, task_id: str) -> int:
    """The pid of the running task's task-runner process (what Airflow records as the task instance's pid)."""
    return stack.rest("GET", f"{run_path(run_id)}/taskInstances/{task_id}")["pid"]


def test_worker_killed_in_every_attempt_fails_the_run_and_release_still_cleans_up(airflow_stack):
    """Attempt 1 loses a worker (SIGKILL); attempt 2 loses the task's own process (SIGKILL of the task runner, as the
    OOM killer would), which runs no cleanup: the launcher's guard ends its workers within 10 s."""
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    for attempt in (1, 2):
        # Both ranks: the scan can catch the group while only one of them has started.
        ranks = wait_until(lambda: len(found := worker_ranks(key)) == 2 and found, 400,
                           f"both trainer workers of attempt {attempt}")
        if attempt == 1:
            os.kill(ranks[0], signal.SIGKILL)
            wait_until(lambda: not worker_ranks(key), 60, f"attempt {attempt}'s group to be stopped")
            continue
        os.kill(task_runner_pid(airflow_stack, run_id, "train"), signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: not processes_of_run(key), 10, "every worker gone after SIGKILL of the task runner", 0.1)
        print(f"SIGKILL of train's task runner: every worker gone after {time.monotonic() - killed:.1f} s")
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["train"] == "failed" and states["release"] == "success", states
    assert states["evaluate"] == "upstream_failed" and states["outcome"] == "failed"
    assert "train failed" in airflow_stack.task_log(DAG, run_id, "outcome")
    assert_released(airflow_stack, run_id)


def test_marking_train_failed_from_outside_ends_every_worker_within_10_seconds(airflow_stack):
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    wait_until(lambda: len(worker_ranks(key)) == 2, 400, "both trainer workers")
    airflow_stack.rest("PATCH", f"{run_path(run_id)}/taskInstances/train", {"new_state": "failed"})
    marked = time.monotonic()
    wait_until(lambda: not processes_of_run(key), 10, "every worker gone after the task was marked failed", 0.1)
    stopped_after_s = time.monotonic() - marked
    print(f"workers gone {stopped_after_s:.1f} s after train was marked failed")
    assert stopped_after_s <= 10

    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    assert airflow_stack.task_states(DAG, run_id)["release"] == "success"
    assert_released(airflow_stack, run_id)


def test_failed_preflight_never_launches_training(airflow_stack):
    # More workers than this machine has GPUs: none on a CPU machine.
    run_id = trigger(airflow_stack, {**FAST, "use_gpu": True,
                                     "num_workers": max(FAST["num_workers"], len(nvidia_gpus()) + 1)})
    assert airflow_stack.wait_for_run(DAG, run_id, timeout=400) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["preflight"] == "failed", states
    assert states["train"] == "upstream_failed" and states["release"] == "success", states
    assert "GPU" in airflow_stack.task_log(DAG, run_id, "preflight")
    assert not Path(storage(airflow_stack).run(run_key(DAG, run_id)).train.url).exists()
    assert_released(airflow_stack, run_id)


def test_marking_the_whole_run_failed_leaves_it_failed_and_release_still_runs(airflow_stack):
    """The UI's "mark run as failed": Airflow kills the running task, skips the rest and leaves the teardowns."""
    run_id = trigger(airflow_stack, LONG)
    key = run_key(DAG, run_id)
    wait_until(lambda: len(worker_ranks(key)) == 2, 400, "both trainer workers")
    airflow_stack.rest("PATCH", run_path(run_id), {"state": "failed"})

    assert airflow_stack.wait_for_run(DAG, run_id, timeout=300) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["train"] == "failed" and states["evaluate"] == "skipped", states
    assert states["release"] == "success" and states["outcome"] == "failed", states
    assert_released(airflow_stack, run_id)


def test_a_release_that_cannot_record_its_result_fails_the_run_and_says_why(airflow_stack):
    """Storage that fails for the release alone (a directory where release.json must go)."""
    run_id = f"manual__release_blocked_{time.time_ns()}"
    run = storage(airflow_stack).run(run_key(DAG, run_id))
    Path(run.release).mkdir(parents=True)
    airflow_stack.wait_for_dag(DAG)
    airflow_stack.cli("dags", "trigger", DAG, "--run-id", run_id, "--conf", json.dumps({**FAST, "baseline": "skip"}))

    assert airflow_stack.wait_for_run(DAG, run_id, timeout=600) == "failed"
    states = airflow_stack.task_states(DAG, run_id)
    assert states["evaluate"] == "success" and states["release"] == "failed" and states["outcome"] == "failed", states
    release_log = airflow_stack.task_log(DAG, run_id, "release", try_number=3)
    assert "could not be recorded" in release_log and "IsADirectoryError" in release_log
    assert "still alive: none" in release_log
    assert "release failed" in airflow_stack.task_log(DAG, run_id, "outcome")
    assert processes_of_run(run_key(DAG, run_id)) == {}


def test_storage_credentials_only_in_an_airflow_connection(airflow_stack, connection_storage_run):
    """S3 storage whose endpoint and keys exist only in an Airflow connection: every task reaches it, release
    included, and the secret appears in no log (the run: tests/e2e/conftest.py, shared with the SSH comparison)."""
    assert not [name for name in airflow_stack.env if name.startswith("AWS_")]
    run_id, secret, bucket, client = (connection_storage_run.run_id, connection_storage_run.secret,
                                      connection_storage_run.bucket, connection_storage_run.client)
    assert connection_storage_run.state == "success"
    assert set(airflow_stack.task_states(DAG, run_id).values()) <= {"success", "skipped"}

    key = run_key(DAG, run_id)
    release = json.loads(client.get_object(Bucket=bucket, Key=f"gpt/runs/{key}/release.json")["Body"].read())
    assert release["clean"] is True
    report = json.loads(client.get_object(Bucket=bucket, Key=f"gpt/runs/{key}/report/report.json")["Body"].read())
    assert report["release"]["clean"] is True
    rank_logs = [item["Key"] for item in client.list_objects_v2(Bucket=bucket, Prefix=f"gpt/runs/{key}/logs/")
                 ["Contents"]]
    assert rank_logs
    for name in rank_logs:
        assert secret.encode() not in client.get_object(Bucket=bucket, Key=name)["Body"].read(), name
    task_logs = list((airflow_stack.home / "logs" / f"dag_id={DAG}" / f"run_id={run_id}").rglob("*"))
    assert [path for path in task_logs if path.is_file()]
    for path in [*task_logs, airflow_stack.log_path]:
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path
