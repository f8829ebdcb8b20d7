"""Throughput watch: warn when a run trained well below the tokens/s it was expected to reach.

Two expectations, each used when it exists: the preflight advisor's prediction for the worker count that trained,
and the last comparable run (same worker count, model shape, batch, precision, backend and hardware), whose
report is in the same storage root. "Well below" is the setting `min_throughput_ratio` (0 = off). The warnings go
into the report, the task log and an alert; they never fail the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# The settings that decide what one step costs: a run differing in any of them is not comparable.
COMPARABLE_SETTINGS = ("num_workers", "backend", "model", "block_size", "batch_size_per_worker", "grad_accum_steps",
                       "mixed_precision", "xla", "use_gpu", "communication", "tokenizer", "workers_per_host")
COMPARABLE_HARDWARE = ("cpu", "cpu_count", "device", "gpu")


def _signature(report: Mapping[str, Any]) -> tuple:
    config = report.get("config") or {}
    hardware = ((report.get("hardware") or {}).get("distributed")) or {}
    return (tuple(config.get(name) for name in COMPARABLE_SETTINGS),
            tuple(hardware.get(name) for name in COMPARABLE_HARDWARE))


def last_comparable(report: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The most recent earlier report of a run with this run's settings and hardware, that trained and was timed."""
    same = [other for other in earlier if _signature(other) == _signature(report)
            and ((other.get("runs") or {}).get("distributed") or {}).get("tokens_per_s")]
    return max(same, key=lambda other: other.get("created_at") or "", default=None)


def warnings(report: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]], ratio: float) -> list[str]:
    """Sentences naming the measured and the expected tokens/s, the ratio and the setting; [] when all is well."""
    measured = (report["runs"]["distributed"] or {}).get("tokens_per_s")
    if not ratio or not measured:
        return []
    found = []
    predicted = (report.get("prediction") or {}).get("predicted_tokens_per_s")
    if predicted and measured < ratio * predicted:
        found.append(
            f"{measured:,.0f} tokens/s is {measured / predicted:.0%} of the {predicted:,.0f} the preflight advisor "
            f"predicted for {report['runs']['distributed']['num_workers']} workers (warning below "
            f"{ratio:.0%}, setting 'min_throughput_ratio'): look for a slow host, link or input pipeline in the "
            "preflight and train logs.")
    previous = last_comparable(report, earlier)
    if previous:
        before = previous["runs"]["distributed"]["tokens_per_s"]
        if measured < ratio * before:
            found.append(
                f"{measured:,.0f} tokens/s is {measured / before:.0%} of the {before:,.0f} of the last comparable run "
                f"{previous['run_id']} (same settings and hardware; warning below {ratio:.0%}, setting "
                "'min_throughput_ratio').")
    return found


def ratio_to_expectation(report: Mapping[str, Any], earlier: Sequence[Mapping[str, Any]]) -> float | None:
    """Measured / expected tokens/s (the lower of the two ratios), for the metrics; None without an expectation."""
    measured = (report["runs"]["distributed"] or {}).get("tokens_per_s")
    expected = [(report.get("prediction") or {}).get("predicted_tokens_per_s")]
    previous = last_comparable(report, earlier)
    if previous:
        expected.append(previous["runs"]["distributed"]["tokens_per_s"])
    ratios = [measured / value for value in expected if value and measured]
    return min(ratios) if ratios else None
