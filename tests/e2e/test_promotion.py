"""Nightly-style runs through the real scheduler: promotion, continuing from the promoted model, the Asset events,
and the samples in the report and on the runs page.

Each run is tiny (12 steps, no baseline) and uses its own registered model name, so other end-to-end runs on the
shared stack neither promote into it nor score it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.layout import run_key
from tasks import registry
from tasks.report.document import RunReport
from tasks.report.parts import read_parts, run_view
from tests.e2e.runs import DAG, FAST, assert_released, storage, trigger
from tests.support.airflow_stack import REPO

pytestmark = pytest.mark.timeout(1200)

NIGHTLY = {**FAST, "baseline": "skip", "promote": "auto", "model_name": f"e2e-nightly-{time.time_ns()}"}
# Adam at the largest allowed learning rate wrecks the weights it continues from: a finite but worse eval loss.
# The loss watch would stop that run in train (the loss jumps ~25 nats); it is off here, so that the run reaches
# promotion, whose own refusal is what this test is about. It checks no export format: only the eval-loss rule is
# under test.
HARMFUL = {"learning_rate": 1.0, "max_loss_rise": 0.0, "export_formats": []}


def report(stack, run_id: str) -> dict:
    """The run's report as its page shows it: report.json with promotion.json and release.json beside it."""
    url = storage(stack).run(run_key(DAG, run_id)).report
    return run_view(RunReport.from_json(json.loads(Path(url, "report.json").read_text()), "report.json"),
                    *read_parts(url)).to_json()


def succeed(stack, conf: dict) -> str:
    run_id = trigger(stack, conf)
    assert stack.wait_for_run(DAG, run_id, timeout=600) == "success", stack.task_states(DAG, run_id)
    assert_released(stack, run_id)
    return run_id


def test_nightly_runs_promote_v1_refuse_a_worse_model_and_promote_v2(airflow_stack):
    name = NIGHTLY["model_name"]
    started = time.monotonic()
    first = succeed(airflow_stack, {**NIGHTLY, "model": "tiny"})
    assert "Promoted run" in airflow_stack.task_log(DAG, first, "promote")
    assert report(airflow_stack, first)["promotion"]["version"] == "v1"

    harmful = succeed(airflow_stack, {**NIGHTLY, "model": "promoted", **HARMFUL})
    log = airflow_stack.task_log(DAG, harmful, "promote")
    assert "Not promoted" in log and "worse than the promoted version by more than 'promotion_tolerance'" in log
    refused = report(airflow_stack, harmful)
    assert refused["continued_from"]["version"] == "v1"
    assert refused["promotion"]["promoted"] is False
    assert "both scored on this run's evaluation sample" in refused["promotion"]["reason"]
    markdown = Path(storage(airflow_stack).run(run_key(DAG, harmful)).report, "report.md").read_text()
    assert "**Not promoted** (policy 'auto'): worse than the promoted version" in markdown

    good = succeed(airflow_stack, {**NIGHTLY, "model": "promoted"})
    promoted = report(airflow_stack, good)
    assert promoted["continued_from"]["version"] == "v1"  # the harmful run moved nothing
    assert promoted["promotion"]["version"] == "v2", promoted["promotion"]
    print(f"three nightly runs through the scheduler: {time.monotonic() - started:.0f} s", file=sys.stderr)

    layout = storage(airflow_stack).model(name)
    pointer = registry.read_latest(layout)
    assert [(entry.version, entry.run_id) for entry in pointer.history] == [("v1", first), ("v2", good)]
    for number in (1, 2):
        assert registry.complete_version(layout.version(number)) is not None
        assert Path(layout.version(number).model, "tokenizer.json").exists()
        assert f"# {name} v{number}" in Path(layout.version(number).model_card).read_text()

    events = airflow_stack.rest("GET", f"/api/v2/assets/events?source_dag_id={DAG}&source_task_id=promote"
                                       "&order_by=timestamp&limit=100")["asset_events"]
    ours = [event for event in events if event["extra"].get("model_name") == name]
    assert [(event["extra"]["version"], event["source_run_id"]) for event in ours] == [("v1", first), ("v2", good)]
    assert {event["name"] for event in ours} == {"gpt_finetune_model"}
    assert ours[1]["extra"]["url"] == layout.version(2).url
    assert ours[1]["extra"]["eval_loss"] == promoted["runs"]["distributed"]["eval_loss"]

    # Samples: each report has the distributed model's and the promoted version's; v1 gives the same text in
    # both later runs (same prompts, same seed, another process).
    samples = {run_id: {section["model"]: section["samples"] for section in report(airflow_stack, run_id)["samples"]}
               for run_id in (first, harmful, good)}
    assert set(samples[first]) == {"distributed"} and set(samples[good]) == {"distributed", "promoted v1"}
    assert samples[harmful]["promoted v1"] == samples[good]["promoted v1"]
    # Text in every top-k sample; a greedy one may be line breaks only (these runs train a few dozen steps, and a
    # model that young often continues every prompt with newlines first).
    assert all(isinstance(sample["greedy"], str) and sample["top_k"].strip() and sample["prompt"]
               for run in samples.values() for section in run.values() for sample in section)
    sys.path.insert(0, str(REPO / "plugins"))
    from gpt_finetune_ui.reports_app import create_app

    client = TestClient(create_app(storage(airflow_stack).root))
    page = client.get(f"/runs/{run_key(DAG, good)}/").text
    assert "<h2>Samples</h2>" in page and "<tr><td>promoted v1</td>" in page
    first_greedy = samples[good]["distributed"][0]["greedy"]
    assert first_greedy.strip()[:20].replace("&", "&amp;").replace("<", "&lt;") in page.replace("&#x27;", "'")
    index = client.get("/").text
    assert f"{name}: latest is <b>v2</b>, produced by run <a href='runs/{run_key(DAG, good)}/'>" in index
