"""The run's report as three files with one writer each (tasks/report/parts.py), read and shown as one."""

import json

from core.storage import join, write_json_atomic
from tasks.report import store as reports
from tasks.report.parts import read_part, read_parts, run_view
from tests.tasks.report.test_store import document

EXPORT_GATE = {"name": "export_safetensors", "passed": False, "value": 0.03, "limit": 1e-4,
               "detail": "export safetensors: max |logit diff| 3.20e-02"}
PROMOTION = {"promoted": False, "policy": "auto", "model_name": "m", "reason": "the run's gates failed",
             "export_gates": [EXPORT_GATE], "exports": {"formats": {}}}
USAGE = {"held_gpu_h": 0.5, "busy_share": 0.8, "warnings": ["GPU time: 20% of the held time was idle"]}
RELEASE = {"clean": True, "released_at": "2026-11-29T10:05:00+00:00", "host": "h", "survivors": [],
           "hosts": [], "usage": USAGE, "charts": {"usage": "usage.png"}}


def test_missing_parts_are_pending(tmp_path):
    assert read_parts(str(tmp_path)) == (None, None)
    markdown = reports.render_markdown(run_view(document(), None, None))
    assert "**Released: pending**" in markdown and "Pending: the promote task has not run yet." in markdown


def test_promote_and_release_parts_fold_into_the_report_without_changing_it():
    evaluated = document()
    view = run_view(evaluated, PROMOTION, RELEASE)
    shown = view.to_json()
    assert evaluated == document() and evaluated.gates_passed, "the report itself is left as evaluate wrote it"
    assert shown["gates"][-1] == EXPORT_GATE and shown["gates_passed"] is False  # a failed export gate counts
    assert shown["promotion"] == {k: v for k, v in PROMOTION.items() if k not in ("export_gates", "exports")}
    assert shown["exports"] == {"formats": {}}
    assert shown["release"] == {"clean": True, "released_at": RELEASE["released_at"], "host": "h", "survivors": []}
    assert shown["usage"] == USAGE and shown["warnings"][-1] == USAGE["warnings"][0]
    assert shown["charts"]["usage"] == "usage.png"
    markdown = reports.render_markdown(view)
    assert "**Gates: FAILED** · **Released: yes**" in markdown
    assert "**Not promoted** (policy 'auto'): the run's gates failed" in markdown
    assert "| export_safetensors | **FAIL** |" in markdown


def test_an_unreadable_part_is_shown_as_such_and_proves_nothing(tmp_path):
    (tmp_path / "promotion.json").write_text("{not json")
    write_json_atomic(join(str(tmp_path), "release.json"), [1, 2])
    promotion, release = read_parts(str(tmp_path))
    assert promotion == {"unreadable": "not valid JSON"} and release == {"unreadable": "not a JSON object"}
    markdown = reports.render_markdown(run_view(document(), promotion, release))
    assert "**Released: no**" in markdown
    assert "**Unknown**: the promote task's record cannot be read (not valid JSON)." in markdown
    (tmp_path / "huge.json").write_text(json.dumps({"x": "y" * (17 << 20)}))
    assert read_part(str(tmp_path / "huge.json"))["unreadable"].startswith("too large")


def test_export_gates_that_are_no_gates_make_the_promotion_unreadable_and_count_nothing():
    """promotion.json is untrusted: its export gates are read as gates (tasks/report/document.py), or not at all."""
    odd = {**PROMOTION, "export_gates": [{**EXPORT_GATE, "passed": "no"}]}
    view = run_view(document(), odd, None)
    assert view.report.gates == document().gates and view.report.gates_passed is True and view.exported is None
    assert view.promotion == {"unreadable": "promotion.json: export_gates[0].passed: expected bool, got str"}
    assert "**Unknown**: the promote task's record cannot be read (promotion.json: export_gates[0].passed" in (
        reports.render_markdown(view))
