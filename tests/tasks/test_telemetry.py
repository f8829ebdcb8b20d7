"""tasks.telemetry: metric names, and what reaches a real StatsD socket through Airflow's own metrics client."""

from __future__ import annotations

import json

import pytest

from tasks import telemetry
from tasks.report.document import RunReport
from tests.support.metrics_sinks import StatsdListener
from tests.tasks.report.test_store import report as base_report
from trainer.metrics import LIVE_PREFIX


def wait_for(listener: StatsdListener, count: int) -> list:
    import time

    deadline = time.monotonic() + 5
    while len(listener.packets) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return listener.packets


def live(scope: str, **values) -> str:
    return LIVE_PREFIX + json.dumps({"scope": scope, "values": values})


def test_names_are_unique_and_within_what_statsd_and_prometheus_accept():
    names = telemetry.metric_names()
    assert len(names) == len(telemetry.WORKER_GAUGES) + sum(map(len, telemetry.TASK_GAUGES.values())) + len(
        telemetry.COUNTERS)
    assert all(name.startswith("gpt_finetune.") and name.replace(".", "_").replace("_", "").isalnum()
               for name in names)


def test_worker_lines_become_gauges_tagged_with_run_task_and_rank(statsd):
    reader = telemetry.LiveLineReader(run="manual__1-abc", task="train")
    assert reader.enabled
    assert reader.consume(1, live("worker", step=7, loss=4.25, tokens_per_s=1200.5, compute_s=0.4))
    assert not reader.consume(1, "step 7/40 loss 4.2500")  # an ordinary line stays in the task log

    packets = {p.name: p for p in wait_for(statsd, 4)}
    assert packets["airflow.gpt_finetune.worker.loss"].tags == {"run": "manual__1-abc", "task": "train", "rank": "1"}
    assert (packets["airflow.gpt_finetune.worker.loss"].value, packets["airflow.gpt_finetune.worker.loss"].kind) == (
        4.25, "g")
    assert {name: p.value for name, p in packets.items()} == {
        "airflow.gpt_finetune.worker.step": 7, "airflow.gpt_finetune.worker.loss": 4.25,
        "airflow.gpt_finetune.worker.tokens_per_s": 1200.5, "airflow.gpt_finetune.worker.compute_s": 0.4}


def test_task_lines_and_report_figures_carry_the_run(statsd):
    reader = telemetry.LiveLineReader(run="r-1", task="preflight")
    reader.consume(0, live("preflight", busbw_gbps=0.8, predicted_efficiency=0.5))
    data = base_report(baseline=False)
    data.update(run_key="r-1", gates=[])
    data["runs"]["distributed"].update(eval_loss=4.9, perplexity=134.3, tokens_per_s=9e3)
    report = RunReport.from_json(data, "report.json")
    assert telemetry.emit_report_metrics(report, throughput_ratio=0.8) == 4  # None is not sent
    packets = {p.name: p for p in wait_for(statsd, 6)}
    assert packets["airflow.gpt_finetune.preflight.busbw_gbps"].tags == {"run": "r-1", "task": "preflight"}
    assert packets["airflow.gpt_finetune.evaluate.throughput_ratio"].value == 0.8
    assert "airflow.gpt_finetune.evaluate.speedup" not in packets


def test_counters(statsd):
    telemetry.count("task_failed", {"run": "r-2", "task": "train"})
    (packet,) = wait_for(statsd, 1)
    assert (packet.name, packet.tags, packet.value, packet.kind) == (
        "airflow.gpt_finetune.task_failed", {"run": "r-2", "task": "train"}, 1, "c")
    with pytest.raises(ValueError, match="unknown counter 'nope'"):
        telemetry.count("nope", {})


def test_a_malformed_line_is_warned_about_once_and_unknown_fields_are_dropped(statsd, caplog):
    reader = telemetry.LiveLineReader(run="r-3", task="train")
    assert reader.consume(0, LIVE_PREFIX + "{not json")
    assert reader.consume(0, LIVE_PREFIX + "[]")
    assert reader.consume(0, live("worker", loss=3.0, secret_field=1))
    (packet,) = wait_for(statsd, 1)
    assert packet.name == "airflow.gpt_finetune.worker.loss"
    assert caplog.text.count("unreadable live metrics line") == 1


def test_metrics_off_sends_nothing_and_still_keeps_live_lines_out_of_the_log(monkeypatch):
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_ON", "False")
    reader = telemetry.LiveLineReader(run="r", task="train")
    assert not reader.enabled and reader.consume(0, live("worker", loss=1.0))
    assert telemetry.emit_task_metrics("release", {"clean": True}, run="r") == 0
    with pytest.raises(ValueError, match=r"release metrics \['nope'\] are not in"):
        telemetry.emit_task_metrics("release", {"nope": 1}, run="r")


@pytest.mark.parametrize("payload", [
    '{"scope":"worker","values":null}',  # the review's reproduction (finding 6): AttributeError out of the group
    '{"scope":"release","values":""}',
    "[" * 100000,  # RecursionError
    '{"scope":"worker","values":{"loss":"4.0"}}',
    '{"scope":"worker","values":{"loss":[1]}}',
    '{"scope":"worker","values":{"loss":1' + "0" * 400 + '}}',
    '{"scope":"nope","values":{}}',
    '{"scope":["worker"],"values":{}}',
    '{"scope":"release","values":{"not_a_release_gauge":1}}',
    '{"scope":"worker","values":{"loss":1.0},"pad":"' + "x" * 20000 + '"}',  # over the length cap: not parsed
])
def test_a_malformed_live_line_is_ignored_and_counted_never_raised(payload, caplog):
    reader = telemetry.LiveLineReader(run="r-4", task="train", enabled=True)
    assert reader.consume(0, LIVE_PREFIX + payload) and reader.consume(1, LIVE_PREFIX + payload)
    assert reader.malformed == 2
    assert caplog.text.count("unreadable live metrics line") == 1


def test_a_line_over_the_cap_is_refused_before_parsing(monkeypatch):
    parsed = []
    monkeypatch.setattr(telemetry.json, "loads", lambda text: parsed.append(text))
    with pytest.raises(telemetry.MalformedLiveLine, match="characters, over 16384"):
        telemetry.parse_live_line("{" + " " * telemetry.MAX_LIVE_LINE_CHARS + "}")
    assert parsed == []


def test_unmeasured_values_pass_and_send_no_gauge(statsd):
    reader = telemetry.LiveLineReader(run="r-5", task="train")
    assert reader.consume(0, live("worker", loss=2.0, gpu_util=None, grad_norm=float("nan")))
    assert reader.malformed == 0
    assert [p.name for p in wait_for(statsd, 1)] == ["airflow.gpt_finetune.worker.loss"]
