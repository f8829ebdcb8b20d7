"""The report's scaling figures: the train task's segments (elastic recovery) and the advisor's prediction next to
the measured speedup and efficiency (shown by tasks/report/view.py).

Inputs: `segments.json` in the training output (one entry per launch of the train task, written by
`tf_multiworker.elastic.ElasticTrainOperator`), the chief's metrics lines, and `preflight.json`'s `advisor`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from core.layout import TrainOutput
from core.storage import exists, read_json
from tasks.report.document import Comparison, Prediction, Segment

log = logging.getLogger("gpt_finetune.scaling")


def read_segments(output: TrainOutput) -> dict[str, Any] | None:
    return read_json(output.segments) if exists(output.segments) else None


def segments(record: Mapping[str, Any] | None, metrics: Sequence[Mapping[str, Any]],
             final_step: int) -> list[Segment]:
    """The steps each launch contributed: from its checkpoint to the next launch's (a launch that failed before
    its first new checkpoint contributed none and is left out), with its workers and measured tokens/s."""
    if not record:
        return []
    launches, asked = record["launches"], record["num_workers"]
    rows = []
    for index, launch in enumerate(launches):
        end = launches[index + 1]["from_step"] if index + 1 < len(launches) else final_step
        if end <= launch["from_step"]:
            continue
        # Throughput of the steps themselves: the first step of a launch (tracing, compiling) and checkpoint
        # writes between steps are left out.
        timed = [m for m in metrics if launch["from_step"] + 1 < m["step"] <= end]
        seconds = sum(m["step_time_s"] for m in timed)
        tokens = sum(m["tokens_per_s"] * m["step_time_s"] for m in timed)
        count = launch["num_workers"]
        if rows and count < asked and launch.get("reason"):
            line = f"continued on {count} of {asked} workers from step {launch['from_step']}: {launch['reason']}"
        elif rows:
            line = f"continued on {count} of {asked} workers from step {launch['from_step']}"
        else:
            line = f"started on {count} of {asked} workers" + (f": {launch['reason']}" if launch.get("reason") else "")
        rows.append(Segment(from_step=launch["from_step"], to_step=end, steps=end - launch["from_step"],
                            num_workers=count, grad_accum_steps=launch["grad_accum_steps"],
                            tokens_per_s=tokens / seconds if seconds > 0 else None, reason=launch.get("reason"),
                            hosts=tuple(launch.get("hosts", [])), try_number=launch.get("try_number"), line=line))
    return rows


def is_elastic(rows: Sequence[Segment], asked: int) -> bool:
    return any(row.num_workers != asked for row in rows)


def prediction(preflight: Mapping[str, Any] | None, measured_workers: int, comparison: Comparison) -> Prediction | None:
    """The advisor's figures for the worker count that trained (the last segment's), next to the measured ones."""
    advice = (preflight or {}).get("advisor") or {}
    rows = {row["num_workers"]: row for row in advice.get("rows") or ()}
    if measured_workers not in rows:
        return None
    row = rows[measured_workers]
    speedup = comparison.speedup
    return Prediction(
        num_workers=measured_workers, predicted_speedup=row["speedup"],
        predicted_efficiency=row["efficiency"], predicted_tokens_per_s=row["tokens_per_s"],
        measured_speedup=speedup, measured_efficiency=comparison.efficiency,
        speedup_error=(row["speedup"] - speedup) / speedup if speedup else None,
        recommendation=advice.get("recommendation"), rows=tuple(advice["rows"]),
        step_source=advice["inputs"]["step_source"],
    )
