"""Throughput watch: warn when a run trained well below the tokens/s it was expected to reach.

Two expectations, each used when it exists: the preflight advisor's prediction for the worker count that trained,
and the last comparable run (same worker count, model shape, batch, precision, backend and hardware), whose
report is in the same storage root. "Well below" is the setting `min_throughput_ratio` (0 = off). The warnings go
into the report, the task log and an alert; they never fail the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.config.schema import flat_settings
from tasks.report.document import RunReport

# The settings that decide what one step costs: a run differing in any of them is not comparable.
COMPARABLE_SETTINGS = ("num_workers", "backend", "model", "block_size", "batch_size_per_worker", "grad_accum_steps",
                       "mixed_precision", "xla", "use_gpu", "communication", "allreduce_dtype", "allreduce_pack_mb",
                       "tokenizer", "workers_per_host")
COMPARABLE_HARDWARE = ("cpu", "cpu_count", "device", "gpu")


def _signature(report: RunReport) -> tuple:
    config = flat_settings(report.config)  # nested, or flat as reports before the sections
    hardware = (report.hardware.distributed if report.hardware else None) or {}
    return (tuple(config.get(name) for name in COMPARABLE_SETTINGS),
            tuple(hardware.get(name) for name in COMPARABLE_HARDWARE))


def last_comparable(report: RunReport, earlier: Sequence[RunReport]) -> RunReport | None:
    """The most recent earlier report of a run with this run's settings and hardware, that trained and was timed."""
    same = [other for other in earlier if _signature(other) == _signature(report)
            and other.runs.distributed.tokens_per_s]
    return max(same, key=lambda other: other.created_at, default=None)


@dataclass(frozen=True)
class Assessment:
    """`warnings`: sentences naming measured and expected tokens/s, the ratio and the setting ([] when all is well);
    `ratio`: measured / expected, the lower of the two, for the metrics (None without an expectation)."""

    warnings: list[str]
    ratio: float | None


def assess(report: RunReport, earlier: Sequence[RunReport], min_ratio: float) -> Assessment:
    """The run's tokens/s against each expectation that exists; a warning for each one it falls below `min_ratio`
    of (0: no warnings)."""
    distributed = report.runs.distributed
    measured = distributed.tokens_per_s
    if not measured:
        return Assessment([], None)
    predicted = report.prediction.predicted_tokens_per_s if report.prediction else None
    previous = last_comparable(report, earlier)
    before = previous.runs.distributed.tokens_per_s if previous else None
    below = f"warning below {min_ratio:.0%}, setting 'min_throughput_ratio'"
    found = []
    if min_ratio and predicted and measured < min_ratio * predicted:
        found.append(
            f"{measured:,.0f} tokens/s is {measured / predicted:.0%} of the {predicted:,.0f} the preflight advisor "
            f"predicted for {distributed.num_workers} workers ({below}): look for a slow host, link or input "
            "pipeline in the preflight and train logs.")
    if min_ratio and before and measured < min_ratio * before:
        found.append(
            f"{measured:,.0f} tokens/s is {measured / before:.0%} of the {before:,.0f} of the last comparable run "
            f"{previous.run_id} (same settings and hardware; {below}).")
    ratios = [measured / value for value in (predicted, before) if value]
    return Assessment(found, min(ratios) if ratios else None)
