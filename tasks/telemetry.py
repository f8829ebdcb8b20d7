"""The run's metrics in Airflow's metrics pipeline (`[metrics]`: StatsD or OpenTelemetry), and their names.

Every name the project emits is listed here, once: the Grafana dashboard (docker/grafana/) may use only these
(tests/docker/test_dashboard.py checks it). Tags are `run` (the run key), `task` and, for worker metrics, `rank`;
nothing else, so the series stay few per run. Airflow adds its `statsd_prefix` ("airflow."); with
`statsd_influxdb_enabled` the tags travel in the name (`airflow.gpt_finetune.worker.loss,run=...,rank=0`), which
the Prometheus StatsD exporter turns into labels.

Worker metrics come from the workers' live lines (`trainer.metrics.LIVE_PREFIX`), which the operator reads from
their output: the workers open no endpoint of their own. When Airflow's metrics are off, nothing is sent.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tasks.report.document import RunReport

log = logging.getLogger("gpt_finetune.telemetry")

PREFIX = "gpt_finetune"
# Per rank, while a training job runs (train and baseline): tags run, task, rank.
WORKER_GAUGES = (
    "step", "loss", "learning_rate", "tokens_per_s", "step_time_s", "input_wait_s", "compute_s", "grad_norm",
    "gpu_util", "gpu_mem_reserved_mb", "gpu_mem_peak_mb",
)
# Per task, when it ends: tags run, task.
TASK_GAUGES = {
    "preflight": ("busbw_gbps", "latency_p50_ms", "predicted_speedup", "predicted_efficiency",
                  "predicted_tokens_per_s"),
    "evaluate": ("eval_loss", "perplexity", "baseline_eval_loss", "loss_delta", "parity_ok", "tokens_per_s",
                 "baseline_tokens_per_s", "speedup", "efficiency", "throughput_ratio"),
    "release": ("clean", "processes_found", "terminated", "killed"),
    # GPU time (tasks/ledger/usage.py): gpus_held while a group runs (task = the group, 0 when it ends), the rest once
    # at release; idle_<cause>_gpu_h per cause of tasks.ledger.usage.CAUSES. "gpu" reads "worker" on CPU runs.
    "usage": ("gpus_held", "price_per_gpu_h", "held_gpu_h", "busy_gpu_h", "idle_gpu_h", "busy_share", "cost",
              "cost_per_mtoken", "time_to_release_s",
              *(f"idle_{cause}_gpu_h" for cause in ("between_tasks", "startup", "stragglers", "preflight", "compile",
                                                    "redone", "evaluation", "export", "release", "other"))),
}
# Counters: tags run and task.
COUNTERS = ("task_failed", "throughput_warning", "alert_sent", "alert_failed", "cost_warning")


def worker_metric(field: str) -> str:
    return f"{PREFIX}.worker.{field}"


def task_metric(scope: str, field: str) -> str:
    return f"{PREFIX}.{scope}.{field}"


def counter_metric(name: str) -> str:
    return f"{PREFIX}.{name}"


def metric_names() -> frozenset[str]:
    """Every metric name this project sends (without Airflow's prefix)."""
    return frozenset(
        [worker_metric(field) for field in WORKER_GAUGES]
        + [task_metric(scope, field) for scope, fields in TASK_GAUGES.items() for field in fields]
        + [counter_metric(name) for name in COUNTERS])


def metrics_enabled() -> bool:
    """Whether this Airflow deployment sends metrics anywhere (StatsD, Datadog or OpenTelemetry)."""
    from airflow.sdk.configuration import conf

    return any(conf.getboolean("metrics", option, fallback=False)
               for option in ("statsd_on", "statsd_datadog_enabled", "otel_on"))


def _stats():
    from airflow.sdk.observability import stats

    return stats


def emit_gauges(names_and_values: Mapping[str, Any], tags: Mapping[str, Any]) -> int:
    """Send each finite number as a gauge when Airflow's metrics are on; returns how many went out."""
    return _send_gauges(names_and_values, tags) if metrics_enabled() else 0


def _send_gauges(names_and_values: Mapping[str, Any], tags: Mapping[str, Any]) -> int:
    """A metrics backend that fails is logged once per call and never fails the task."""
    sent = 0
    try:
        stats = _stats()
        for name, value in names_and_values.items():
            if isinstance(value, bool):
                value = int(value)
            if isinstance(value, (int, float)) and math.isfinite(value):
                stats.gauge(name, float(value), tags={k: str(v) for k, v in tags.items()})
                sent += 1
    except Exception as error:  # noqa: BLE001 - metrics are best effort; the run's outcome is what matters
        log.warning("could not send metrics (%s): %s", type(error).__name__, error)
    return sent


def count(name: str, tags: Mapping[str, Any]) -> None:
    """Increment the counter `name` (one of COUNTERS); best effort as `emit_gauges`."""
    if name not in COUNTERS:
        raise ValueError(f"unknown counter {name!r}: add it to tasks.telemetry.COUNTERS (and the dashboard)")
    if not metrics_enabled():
        return
    try:
        _stats().incr(counter_metric(name), tags={k: str(v) for k, v in tags.items()})
    except Exception as error:  # noqa: BLE001 - as in emit_gauges
        log.warning("could not send metric %s (%s): %s", name, type(error).__name__, error)


def _task_gauges(scope: str, values: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(values) - set(TASK_GAUGES[scope])
    if unknown:
        raise ValueError(f"{scope} metrics {sorted(unknown)} are not in tasks.telemetry.TASK_GAUGES")
    return {task_metric(scope, field): value for field, value in values.items()}


def emit_task_metrics(scope: str, values: Mapping[str, Any], *, run: str) -> int:
    """The gauges of one task (a TASK_GAUGES scope), tagged with the run; unknown fields are an error in code."""
    return emit_gauges(_task_gauges(scope, values), {"run": run, "task": scope})


def emit_report_metrics(report: RunReport, throughput_ratio: float | None) -> int:
    """The evaluate task's figures (its report.json) as gauges."""
    distributed, baseline, comparison = report.runs.distributed, report.runs.baseline, report.comparison
    parity = next((gate.passed for gate in report.gates if gate.name == "loss_parity"), None)
    return emit_task_metrics("evaluate", {
        "eval_loss": distributed.eval_loss, "perplexity": distributed.perplexity,
        "baseline_eval_loss": baseline.eval_loss if baseline else None, "loss_delta": comparison.loss_delta,
        "parity_ok": parity, "tokens_per_s": distributed.tokens_per_s,
        "baseline_tokens_per_s": baseline.tokens_per_s if baseline else None, "speedup": comparison.speedup,
        "efficiency": comparison.efficiency, "throughput_ratio": throughput_ratio,
    }, run=report.run_key)


# A live line is a few hundred characters; a longer one is not parsed at all (a worker's stray output, or a value
# that is not a metric). Lines the launcher delivers are cut long before (launcher.worker_output.MAX_LINE_BYTES).
MAX_LIVE_LINE_CHARS = 16384


class MalformedLiveLine(ValueError):
    """A live line that is not `{"scope": <scope>, "values": {<name>: <finite number>, ...}}`."""


class LiveLineReader:
    """Turns the workers' live lines (`trainer.metrics.LIVE_PREFIX` + JSON) into gauges for one task.

    `consume(rank, line)` returns True when the line was a live line (sent, or dropped when metrics are off), so
    the caller leaves it out of the task log; the rank's log file keeps it. It never raises: a malformed line (too
    long, not JSON, nested too deep, values that are not numbers, an unknown scope or field) is ignored and counted
    in `malformed`, with one warning per task.
    """

    def __init__(self, *, run: str, task: str, enabled: bool | None = None) -> None:
        from trainer.metrics import LIVE_PREFIX

        self.prefix = LIVE_PREFIX
        self.run, self.task = run, task
        self.enabled = metrics_enabled() if enabled is None else enabled
        self.malformed = 0

    def consume(self, rank: int, line: str) -> bool:
        if not line.startswith(self.prefix):
            return False
        if not self.enabled:
            return True
        try:
            scope, values = parse_live_line(line[len(self.prefix):])
            if scope == "worker":  # `enabled` was read once for the task: no configuration lookup per line
                known = {worker_metric(k): v for k, v in values.items() if k in WORKER_GAUGES}
                _send_gauges(known, {"run": self.run, "task": self.task, "rank": rank})
            else:
                _send_gauges(_task_gauges(scope, values), {"run": self.run, "task": scope})
        except Exception as error:  # noqa: BLE001 - a malformed line is a bug, never the run's problem
            self.malformed += 1
            if self.malformed == 1:  # one warning per task
                log.warning("rank %d: unreadable live metrics line, ignored (%s: %.200s): %r", rank,
                            type(error).__name__, error, line[:200])
        return True


def parse_live_line(payload: str) -> tuple[str, dict[str, float | None]]:
    """(scope, values) of a live line's JSON, each value a float or None (not measured: no gauge); MalformedLiveLine
    for anything else. The length is checked before parsing, so the work is linear in a bounded input."""
    if len(payload) > MAX_LIVE_LINE_CHARS:
        raise MalformedLiveLine(f"{len(payload)} characters, over {MAX_LIVE_LINE_CHARS}")
    try:
        message = json.loads(payload)
    except RecursionError:
        raise MalformedLiveLine("nested too deep") from None
    except ValueError as error:  # not JSON
        raise MalformedLiveLine(str(error)[:200]) from None
    if not isinstance(message, dict) or not isinstance(message.get("scope"), str):
        raise MalformedLiveLine("not an object with a string 'scope'")
    scope, values = message["scope"], message.get("values")
    if scope != "worker" and scope not in TASK_GAUGES:
        raise MalformedLiveLine(f"unknown scope {scope[:40]!r}")
    if not isinstance(values, dict):
        raise MalformedLiveLine(f"'values' is {type(values).__name__}, not an object")
    return scope, {name: _number(name, value) for name, value in values.items()}


def _number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)):
        raise MalformedLiveLine(f"value {name[:40]!r} is {type(value).__name__}, not a number")
    try:
        return float(value)  # NaN and infinities pass here and are left out as gauges
    except OverflowError:
        raise MalformedLiveLine(f"value {name[:40]!r} is out of range") from None
