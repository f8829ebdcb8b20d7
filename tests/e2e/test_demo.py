"""The README's main command, `make demo-s3` in miniature: `airflow dags test` of the whole chain with storage on a
local S3 server, ending with the report's path and a promoted model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.runs import DAG, FAST, assert_no_library_noise
from tests.support.airflow_stack import REPO, airflow_env, free_port

pytestmark = pytest.mark.timeout(900)


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
    assert "| known words |" in result.stdout and "Known words: the share" in result.stdout
    assert_no_library_noise(output)  # every task's log, the workers' output included
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
