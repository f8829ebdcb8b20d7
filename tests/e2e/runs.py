"""What the end-to-end tests share: the DAG's small settings, triggering a run on a stack, finding a run's trainer
workers and task runner, waiting, and checking that a run's release left nothing behind."""

from __future__ import annotations

import json
import time
import urllib.parse
from pathlib import Path

from core.layout import StorageLayout, run_key
from tasks.release import processes_of_run
from tests.support.hardware import assert_gpu_check_matches_this_machine

DAG = "gpt_finetune"
# No promotion: these runs test the pipeline, and a promoted version would be scored again by every later run
# (tests/e2e/test_promotion.py promotes).
FAST = {"num_workers": 2, "tokenizer": "bpe:512", "block_size": 32, "batch_size_per_worker": 4,
        "max_steps": 12, "warmup_steps": 2, "checkpoint_every_steps": 4, "startup_timeout_s": 240, "promote": "never"}
# Long enough that a checkpoint exists well before the end, short enough for CI.
LONG = {**FAST, "baseline": "skip", "max_steps": 300, "checkpoint_every_steps": 25}


# Library chatter that launcher/log_policy.py keeps out of the task logs.
LIBRARY_NOISE = (
    "Connected (version",  # paramiko.transport INFO
    "Authentication (publickey) successful",  # paramiko.transport INFO
    "Found credentials in environment variables",  # botocore.credentials INFO
    "TensorFlow and JAX classes are deprecated",  # transformers
    "All model checkpoint layers were used",  # transformers
    "right-padding was detected",  # transformers' TF generate (no longer used)
    "Could not import graphviz",  # Airflow's CLI
    "starlette.testclient` is deprecated",  # Airflow's in-process execution API
    "absl::InitializeLog() is called",  # TensorFlow's native start-up
    "Could not find cuda drivers",  # TensorFlow's native start-up
    "oneDNN custom operations are on",  # TensorFlow's native start-up on oneDNN CPUs (port.cc)
    "This TensorFlow binary is optimized to use available CPU",  # ... on AVX-512 CPUs (cpu_feature_guard.cc)
    "rebuild TensorFlow with the appropriate compiler flags",  # ... its second line
    "CollectiveAllReduceStrategy eagerly",  # TensorFlow, once per worker
)


def assert_no_library_noise(text: str) -> None:
    found = [noise for noise in LIBRARY_NOISE if noise in text]
    assert not found, f"library chatter in the task logs: {found}"


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
            entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
            environ = dict(item.split("=", 1) for item in entries if "=" in item)
        except (FileNotFoundError, ProcessLookupError):  # exited since the scan
            continue
        if "TF_CONFIG" not in environ:  # exiting since the scan: a dying process's environ reads empty
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


def task_runner_pid(stack, run_id: str, task_id: str) -> int:
    """The pid of the running task's task-runner process (what Airflow records as the task instance's pid)."""
    return stack.rest("GET", f"{run_path(run_id)}/taskInstances/{task_id}")["pid"]
