"""The whole pipeline triggered on a real scheduler: a run that tokenizes in mapped tasks and the nightly run after
it that reuses shards and baseline, a preflight that fails before training, and a release that cannot record its
result. (Storage reached only through an Airflow connection: tests/e2e/test_ssh_pipeline.py, whose SSH run must
match that local run.)

Small settings keep each run to about a minute on 2 cores; everything else is real: Airflow's scheduler with the
LocalExecutor, worker processes on loopback, shards and checkpoints in storage, and the release teardown.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

import pytest

from core.layout import run_key
from tasks.release import processes_of_run
from tasks.report.document import RunReport
from tasks.report.parts import read_parts, run_view
from tests.e2e.runs import DAG, FAST, assert_released, run_path, storage, trigger
from tests.support.airflow_stack import REPO
from tests.support.hardware import nvidia_gpus

pytestmark = pytest.mark.timeout(900)


def fan_out_corpus(directory: Path) -> Path:
    """Three files of about 0.85 MB (the sample plays, repeated): three 1 MB units, two lanes with prepare_tasks 2."""
    directory.mkdir(parents=True, exist_ok=True)
    for play in sorted((REPO / "data" / "sample").glob("*.txt")):
        (directory / play.name).write_text("\n\n".join([play.read_text(encoding="utf-8")] * 9), encoding="utf-8")
    return directory


def mapped_states(stack, run_id: str, task_id: str) -> list[str]:
    page = stack.rest("GET", f"{run_path(run_id)}/taskInstances?limit=100")
    return [row["state"] for row in page["task_instances"] if row["task_id"] == task_id]


def assert_metrics_arrived_while_training(stack, run_id: str) -> None:
    """Airflow's StatsD metrics (the stack sends them to a UDP listener of the test): every rank's step, loss and
    tokens/s before train ended, tagged with the run, task and rank; the task figures after; no metrics line in
    the task log."""
    key = run_key(DAG, run_id)
    train = stack.rest("GET", f"{run_path(run_id)}/taskInstances/train")
    train_ended = datetime.fromisoformat(train["end_date"]).timestamp()
    statsd = stack.sinks.statsd
    for rank in ("0", "1"):
        for field in ("step", "loss", "tokens_per_s"):
            packets = statsd.matching(f"gpt_finetune.worker.{field}", run=key, task="train", rank=rank)
            assert packets and packets[0].received < train_ended, (rank, field, packets)
    assert max(p.value for p in statsd.matching("gpt_finetune.worker.step", run=key, task="train")) == FAST["max_steps"]
    for name in ("preflight.busbw_gbps", "evaluate.eval_loss", "evaluate.speedup", "release.clean",
                 "usage.held_gpu_h", "usage.cost", "usage.gpus_held"):
        assert statsd.matching(f"gpt_finetune.{name}", run=key), name
    assert "@gpt_finetune.metrics" not in stack.task_log(DAG, run_id, "train")


def _epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def assert_usage_matches_airflow(stack, run_id: str, report: dict) -> None:
    """The report's GPU-time ledger against independent records: busy = the summaries' train time x workers; the
    held window starts inside preflight's task instance and covers every GPU task instance to release, whose own
    task instance holds released_at (Airflow's metadata database, through its REST API), less the time a GPU task
    waited for admission between groups; waited = every try's scheduled -> queued there; cost = held x rate."""
    from core.storage import read_json
    from tests.conftest import STACK_PRICES

    usage = report["usage"]
    trained = ["distributed"] + (["baseline"] if (report.get("baseline") or {}).get("trained_by_run") else [])
    runs = [report["runs"][name] for name in trained]
    busy_s = sum(read_json(run["summary_url"])["train_time_s"] * run["num_workers"] for run in runs)
    assert usage["busy_gpu_h"] * 3600 == pytest.approx(busy_s, abs=0.05)
    page = stack.rest("GET", f"{run_path(run_id)}/taskInstances?limit=100")["task_instances"]
    instances = {row["task_id"]: (_epoch(row["start_date"]), _epoch(row["end_date"])) for row in page
                 if row["task_id"] in ("preflight", "train", "baseline", "evaluate", "release")}
    run = storage(stack).run(run_key(DAG, run_id))
    events = [json.loads(path.read_text()) for path in Path(run.url, "usage").glob("*-a*.json")]
    first_launch = min(rank["launch"] for event in events for rank in event["ranks"])
    released_at = _epoch(json.loads(Path(run.release).read_text())["released_at"])
    assert instances["preflight"][0] <= first_launch <= instances["preflight"][1]
    assert instances["release"][0] <= released_at <= instances["release"][1]
    last_gpu_task_end = max(end for task, (_, end) in instances.items() if task != "release")
    tries = [row for task in {event["group"].split("-")[0] for event in events}
             for row in stack.rest("GET", f"{run_path(run_id)}/taskInstances/{task}/tries")["task_instances"]]
    waited = sum(_epoch(row["queued_when"]) - _epoch(row["scheduled_when"]) for row in tries
                 if row["queued_when"] and row["scheduled_when"])
    assert usage["waited_s"] == pytest.approx(waited, abs=0.01) and usage["waited_note"] is None, usage
    assert {row["task_id"] for row in usage["admission"]} >= {"preflight", "train", "evaluate"}
    for slot in usage["per_slot"]:  # both workers' slots held from the first launch to release, less waits between
        waited_between = slot["waited_h"] * 3600
        assert 0 <= waited_between <= waited + 0.01, slot
        assert slot["held_h"] * 3600 >= last_gpu_task_end - first_launch - waited_between - 0.05, slot
        assert slot["held_h"] * 3600 == pytest.approx(released_at - first_launch - waited_between, abs=0.05)
    assert sum(usage["idle_by_cause_gpu_h"].values()) == pytest.approx(usage["idle_gpu_h"], abs=1e-5)
    rate = STACK_PRICES["cpu_worker"]["on_demand"]
    assert usage["price"]["rate"] == rate and usage["price"]["unit"] == "worker_hour"
    assert usage["cost"]["held"] == pytest.approx(usage["held_gpu_h"] * rate, abs=1e-6)
    line = Path(run.report, "report.md").read_text().split("## GPU time and cost")[1].strip().splitlines()[0]
    print(f"\nGPU time of {run_id}: {line}; waited for admission {waited:.2f} s (not charged)")


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
    assert_metrics_arrived_while_training(airflow_stack, first)
    # The report as its page shows it: release.json beside it holds the GPU-time ledger (tasks/report/parts.py).
    report = run_view(RunReport.from_json(json.loads(Path(run.report, "report.json").read_text()), "report.json"),
                      *read_parts(run.report)).to_json()
    assert_usage_matches_airflow(airflow_stack, first, report)

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
