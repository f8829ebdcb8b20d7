"""A run's report is three files beside each other, each with one writer: `report.json` (evaluate), `promotion.json`
(promote) and `release.json` (release). This reads them as the one report its view shows (tasks/report_view.py):
report.md (written by release alone, the last task, once all three are final) and the run's page render the same
merge, and no task rewrites another's file.

The parts are untrusted input like the report (tasks/report_file.py limits): a missing part reads None (pending), an
unreadable one `{"unreadable": why}`, which the view shows as such (a release that cannot be read is no proof).
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.report_file import UnreadableRecord, read_record
from trainer.layout import PROMOTION_JSON, RELEASE_JSON
from trainer.storage import exists, join

log = logging.getLogger("gpt_finetune.report")

UNREADABLE = "unreadable"
RELEASE_FIELDS = ("clean", "released_at", "host", "survivors")  # what the report shows of the release record
PROMOTION_ONLY = ("export_gates", "exports")  # promotion.json's fields that the view places elsewhere


def read_part(url: str) -> dict[str, Any] | None:
    """The part at `url`: None when it does not exist, `{"unreadable": why}` when it cannot be read or is no JSON
    object (logged), else its object."""
    try:
        if not exists(url):
            return None
        value = read_record(url)
    except (UnreadableRecord, OSError) as error:
        log.warning("Unreadable report part %s (%s)", url, error)
        return {UNREADABLE: getattr(error, "reason", "cannot be read")}
    return value if isinstance(value, dict) else {UNREADABLE: "not a JSON object"}


def read_parts(report_url: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """promotion.json and release.json of the report directory `report_url` (each as `read_part` reads it)."""
    return read_part(join(report_url, PROMOTION_JSON)), read_part(join(report_url, RELEASE_JSON))


def run_report(report: dict[str, Any], promotion: dict[str, Any] | None,
               release: dict[str, Any] | None) -> dict[str, Any]:
    """The report as its view shows it: evaluate's `report` with promote's export gates and verdict (`promotion`,
    `exports`; `gates_passed` then counts the export gates) and release's outcome (`release`) and GPU-time ledger
    (`usage`, its warnings and chart) folded in. A missing part adds nothing: the view says pending."""
    merged = dict(report)
    if isinstance(promotion, dict):
        merged.update(_promotion(report, promotion))
    if isinstance(release, dict):
        merged.update(_release(report, release))
    return merged


def _promotion(report: dict[str, Any], promotion: dict[str, Any]) -> dict[str, Any]:
    if UNREADABLE in promotion:
        return {"promotion": {UNREADABLE: promotion[UNREADABLE]}}
    verdict = {name: value for name, value in promotion.items() if name not in PROMOTION_ONLY}
    return {**with_exports(report, promotion), "promotion": verdict}


def with_exports(report: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """`report` with promote's export gates after its own (`gates_passed` then counts them too) and the exports'
    parity record (`exports`), from `part` (promotion.json, or what promote is about to write there)."""
    merged = dict(report)
    export_gates = [gate for gate in _list(part.get("export_gates")) if isinstance(gate, dict)]
    if export_gates:
        merged["gates"] = _list(report.get("gates")) + export_gates
        merged["gates_passed"] = report.get("gates_passed") is True and all(
            gate.get("passed") is True for gate in export_gates)
    if "exports" in part:
        merged["exports"] = part["exports"]
    return merged


def _release(report: dict[str, Any], release: dict[str, Any]) -> dict[str, Any]:
    if UNREADABLE in release:
        return {"release": {"clean": False, UNREADABLE: release[UNREADABLE]}}
    folded: dict[str, Any] = {"release": {name: release.get(name) for name in RELEASE_FIELDS}}
    usage = release.get("usage")
    if isinstance(usage, dict):
        warnings = [warning for warning in _list(usage.get("warnings")) if isinstance(warning, str)]
        folded.update(usage=usage, warnings=_list(report.get("warnings")) + warnings)
    charts, own = report.get("charts"), release.get("charts")  # release's: the ledger's chart
    if isinstance(own, dict) and own:
        folded["charts"] = {**(charts if isinstance(charts, dict) else {}),
                            **{name: file for name, file in own.items() if isinstance(file, str)}}
    return folded


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []
