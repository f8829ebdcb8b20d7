"""A run's report is three files beside each other, each with one writer: `report.json` (evaluate), `promotion.json`
(promote) and `release.json` (release). This reads them as the one report its view shows (tasks/report/view.py), a
`RunView`: report.md (written by release alone, the last task, once all three are final) and the run's page render
the same merge, and no task rewrites another's file.

The parts are untrusted input like the report (tasks/report/untrusted.py limits): a missing part reads None (pending),
an unreadable one `{"unreadable": why}`, which the view shows as such (a release that cannot be read is no proof); so
does a promotion whose export gates are not gates (tasks/report/document.py checks them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from core.layout import PROMOTION_JSON, RELEASE_JSON
from core.storage import exists, join
from tasks.report.document import ExportPart, ReportError, RunReport
from tasks.report.untrusted import UnreadableRecord, read_record

log = logging.getLogger("gpt_finetune.report")

UNREADABLE = "unreadable"
RELEASE_FIELDS = ("clean", "released_at", "host", "survivors")  # what the report shows of the release record
PROMOTION_ONLY = ("export_gates", "exports")  # promotion.json's fields that the view places elsewhere


@dataclasses.dataclass(frozen=True)
class RunView:
    """A run's report as its view shows it: evaluate's report with what promote and release wrote beside it.

    Attributes:
        report: evaluate's report with promote's export gates after its own (`gates_passed` then counts them) and
            the GPU-time ledger's warnings and chart (release's) added to its own.
        exported: promote's export gates and parity record; None when promotion.json has none (not promoted yet,
            `export_formats` = [], or unreadable).
        promotion: promotion.json's verdict (its fields but the export ones); `{"unreadable": why}` when it cannot
            be read; None: pending.
        release: release.json's RELEASE_FIELDS; `{"clean": False, "unreadable": why}` when it cannot be read;
            None: pending.
        usage: release's GPU-time ledger (tasks/ledger/record.py); None without one.
    """

    report: RunReport
    exported: ExportPart | None = None
    promotion: dict[str, Any] | None = None
    release: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None

    @property
    def released(self) -> str:
        return released(self.release)

    def to_json(self) -> dict[str, Any]:
        """The merged report as JSON (the UI's API, a promoted version's report.json): the report's keys, then
        `exports`, `promotion`, `release` and `usage` where there are some."""
        merged = self.report.to_json()
        if self.exported is not None:
            merged["exports"] = self.exported.exports
        parts = {"promotion": self.promotion, "release": self.release, "usage": self.usage}
        return {**merged, **{name: part for name, part in parts.items() if part is not None}}


def released(release: dict[str, Any] | None) -> str:
    """yes / no (something of the run outlived release, or its record cannot be read) / pending (release has not
    run yet), from release.json as `read_part` reads it."""
    if release is None:
        return "pending"
    return "yes" if release.get("clean") is True else "no"


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


def run_view(report: RunReport, promotion: dict[str, Any] | None, release: dict[str, Any] | None) -> RunView:
    """The report as its view shows it: evaluate's `report` with promote's export gates and verdict (`promotion`)
    and release's outcome and GPU-time ledger (`release`) folded in. A missing part adds nothing: the view says
    pending."""
    view = RunView(report)
    if promotion is not None:
        view = _with_promotion(view, promotion)
    if release is not None:
        view = _with_release(view, release)
    return view


def _with_promotion(view: RunView, promotion: dict[str, Any]) -> RunView:
    if UNREADABLE in promotion:
        return dataclasses.replace(view, promotion={UNREADABLE: promotion[UNREADABLE]})
    exported = None
    if any(name in promotion for name in PROMOTION_ONLY):
        try:
            exported = ExportPart.from_json({name: promotion.get(name) for name in PROMOTION_ONLY}, PROMOTION_JSON)
        except ReportError as error:
            log.warning("Unreadable report part %s", error)
            return dataclasses.replace(view, promotion={UNREADABLE: f"{PROMOTION_JSON}: {error.brief}"})
    verdict = {name: value for name, value in promotion.items() if name not in PROMOTION_ONLY}
    return dataclasses.replace(with_exports(view, exported), promotion=verdict)


def with_exports(view: RunView, exported: ExportPart | None) -> RunView:
    """`view` with promote's export gates after the report's own (`gates_passed` then counts them too) and the
    exports' parity record, from `exported` (promotion.json's, or what promote is about to write there)."""
    if exported is None:
        return view
    report = view.report
    gates = report.gates + exported.export_gates
    passed = report.gates_passed and all(gate.passed for gate in exported.export_gates)
    return dataclasses.replace(view, exported=exported,
                               report=dataclasses.replace(report, gates=gates, gates_passed=passed))


def _with_release(view: RunView, release: dict[str, Any]) -> RunView:
    if UNREADABLE in release:
        return dataclasses.replace(view, release={"clean": False, UNREADABLE: release[UNREADABLE]})
    report = view.report
    usage = release.get("usage") if isinstance(release.get("usage"), dict) else None
    listed = (usage or {}).get("warnings")
    warnings = [warning for warning in listed if isinstance(warning, str)] if isinstance(listed, list) else []
    own = release.get("charts")  # the ledger's chart
    charts = {name: file for name, file in own.items() if isinstance(file, str)} if isinstance(own, dict) else {}
    report = dataclasses.replace(report, warnings=report.warnings + tuple(warnings),
                                 charts={**report.charts, **charts})
    return dataclasses.replace(view, report=report, usage=usage,
                               release={name: release.get(name) for name in RELEASE_FIELDS})
