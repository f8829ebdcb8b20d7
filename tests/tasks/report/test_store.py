"""Report rendering: the table, missing figures, charts as real PNGs, and the history of earlier runs."""

import logging

import pytest

from core.storage import exists, join, read_bytes, read_json, write_bytes_atomic, write_json_atomic
from tasks.report import formatting
from tasks.report import store as reports
from tasks.report.document import ReportError, RunReport, table_rows
from tasks.report.parts import RunView, run_view


def run(label, workers, train_time_s, tokens_per_s, eval_loss):
    output = f"/storage/runs/r/{label}"
    return {"label": label, "num_workers": workers, "global_batch_size": 16, "steps": 40, "tokens_seen": 40960,
            "train_time_s": train_time_s, "wall_time_s": train_time_s + 10, "eval_time_s": 2.0,
            "tokens_per_s": tokens_per_s, "final_loss": eval_loss - 0.1, "eval_loss": eval_loss,
            "perplexity": 2.718 ** eval_loss, "eval_tokens": 4096, "output_url": output, "model_url": f"{output}/model",
            "summary_url": f"{output}/summary.json"}


def report(run_id="manual__1", workers=2, efficiency=0.45, baseline=True):
    """report.json as an earlier version of evaluate wrote it: the fields of the first reports."""
    report = {
        "format_version": 1, "run_id": run_id, "run_key": f"{run_id}-k", "created_at": "2026-11-29T10:00:00+00:00",
        "num_workers": workers, "gates_passed": True,
        "runs": {"distributed": run("distributed", workers, 40.0, 1000.0 * workers * efficiency, 5.31),
                 "baseline": run("baseline", 1, 40.0 * workers * efficiency, 1000.0, 5.30) if baseline else None},
        "comparison": {"speedup": workers * efficiency if baseline else None,
                       "efficiency": efficiency if baseline else None,
                       "loss_delta": 0.01 if baseline else None, "loss_tolerance": 0.02},
        "gates": [{"name": "loss_parity", "passed": True, "value": 0.01, "limit": 0.02, "detail": "within"}],
        "baseline": {"policy": "auto" if baseline else "skip", "key": "tiny-k", "trained_by_run": run_id,
                     "reused": False},
        "hardware": {"line": "2 workers on a 2-core CPU: efficiency is bounded by cores."},
        "versions": {"tensorflow": "2.21.0"},
        "charts": {"loss_curves": reports.LOSS_CHART, "scaling": reports.SCALING_CHART},
    }
    report["table"] = table_rows(document_of(report))
    return report


def document_of(report: dict) -> RunReport:
    return RunReport.from_json(report, "report.json")


def document(*args, **kwargs) -> RunReport:
    """`report(...)` as evaluate's typed document."""
    return document_of(report(*args, **kwargs))


def view_of(data: dict, promotion: dict | None = None, release: dict | None = None) -> RunView:
    """The report `data` as its view shows it, with promote's and release's parts."""
    return run_view(document_of(data), promotion, release)


def test_table_puts_the_reference_first_and_shows_missing_figures_as_dashes():
    rows = table_rows(document())
    assert [row["run"] for row in rows] == ["baseline", "distributed"]
    assert (rows[0]["speedup"], rows[0]["efficiency"]) == ("1.00x", "100%")
    assert (rows[1]["speedup"], rows[1]["efficiency"], rows[1]["tokens/s"]) == ("0.90x", "45%", "900")

    alone = report(baseline=False)
    alone["runs"]["distributed"]["tokens_per_s"] = None
    (row,) = table_rows(document_of(alone))
    assert (row["speedup"], row["efficiency"], row["tokens/s"]) == ("—", "—", "—")
    assert (row["nats/char"], row["known words"]) == ("—", "— / —")  # a report from before these figures
    assert formatting.fmt(float("nan")) == "—"
    assert (formatting.nats(0.01), formatting.nats(-1.06e-7), formatting.nats(0.0)) == (
        "+0.0100", "-1.06e-07", "+0.0000")


def test_markdown_and_text_table_carry_the_same_rows():
    data = report()
    markdown = reports.render_markdown(view_of(data))
    assert "| baseline | 1 | 36.0 s | 2.0 s | 1,000 | 1.00x | 100% | 5.3000 |" in markdown
    assert "(tolerance ±0.0200)" in markdown and "efficiency is bounded by cores" in markdown
    assert "![scaling](scaling.png)" in markdown
    text = reports.text_table(data["table"]).splitlines()
    assert text[0].split(" | ")[0].strip() == "run" and len(text) == 4
    assert "skipped (policy 'skip')" in reports.render_markdown(view_of(report(baseline=False)))


def test_markdown_puts_throughput_warnings_above_the_table():
    data = report()
    assert "Warning" not in reports.render_markdown(view_of(data))
    data["warnings"] = ["4,000 tokens/s is 40% of the 10,000 the preflight advisor predicted for 2 workers"]
    markdown = reports.render_markdown(view_of(data))
    assert "> **Warning:** 4,000 tokens/s is 40% of the 10,000" in markdown
    assert markdown.index("**Warning:**") < markdown.index("| " + formatting.TABLE_COLUMNS[0])


def test_markdown_says_whether_the_run_was_released_beside_the_gates():
    data = report()
    assert "**Gates: PASSED** · **Released: pending**" in reports.render_markdown(view_of(data))
    release = {"clean": True, "released_at": "2026-11-29T10:05:00+00:00", "host": "h", "survivors": []}
    assert "**Released: yes**" in reports.render_markdown(view_of(data, release=release))
    release = {**release, "clean": False, "survivors": [123]}
    assert "**Released: no**" in reports.render_markdown(view_of(data, release=release))


def test_markdown_keeps_every_cell_on_one_line_and_in_its_column():
    data = report()
    data["gates"][0]["detail"] = "within | below\nthe tolerance"
    markdown = reports.render_markdown(view_of(data))
    assert "| loss_parity | **pass** | 0.01 | 0.02 | within \\| below the tolerance |" in markdown
    assert "\n\n\n" not in markdown  # one blank line between blocks


def test_known_words_column_reads_greedy_then_top_k():
    data = report()
    data["runs"]["distributed"]["known_words"] = {"greedy": 0.953, "top_k": 0.9, "words": {"greedy": 43, "top_k": 60}}
    data["runs"]["distributed"]["nats_per_char"] = 1.7423
    row = table_rows(document_of(data))[1]
    assert (row["nats/char"], row["known words"]) == ("1.742", "95% / 90%")
    assert formatting.KNOWN_WORDS_NOTE in reports.render_markdown(view_of(data))


def test_history_reads_every_earlier_report_and_skips_unreadable_ones(tmp_path, caplog):
    runs_url = str(tmp_path / "runs")
    for run_id, workers, efficiency in (("r1", 2, 0.5), ("r2", 4, 0.25), ("current", 2, 0.4)):
        write_json_atomic(join(runs_url, run_id, "report", "report.json"), report(run_id, workers, efficiency))
    write_bytes_atomic(join(runs_url, "broken", "report", "report.json"), b"{not json")
    write_json_atomic(join(runs_url, "pending", "config.json"), {})  # a run still training: no report yet

    with caplog.at_level(logging.WARNING, logger="gpt_finetune.report"):
        earlier = reports.earlier_reports(runs_url, exclude_run_key="current")
    points = [point for report in earlier for point in reports.history_point(report)]

    assert sorted((p["run_id"], p["num_workers"], p["efficiency"]) for p in points) == [
        ("r1", 1, 1.0), ("r1", 2, 0.5), ("r2", 1, 1.0), ("r2", 4, 0.25)]
    assert "broken/report/report.json" in caplog.text


def test_evaluate_writes_report_json_and_charts_and_release_renders_report_md(tmp_path):
    url = str(tmp_path / "report")
    write_json_atomic(join(url, "preflight.json"), {"ok": True})  # written earlier by the preflight task
    json_url = reports.write_report(url, document(), {"scaling.png": b"\x89PNG fake"})
    assert json_url == join(url, "report.json") and exists(json_url)
    assert read_bytes(join(url, "scaling.png")) == b"\x89PNG fake"
    assert not exists(join(url, "report.md"))  # release's, once promotion.json and release.json are final
    assert exists(join(url, "preflight.json"))
    assert document_of(read_json(json_url)) == document()

    reports.render_report_md(url)
    assert read_bytes(join(url, "report.md")).startswith(b"# GPT fine-tune run `manual__1`")


def test_no_report_md_without_a_readable_report_json(tmp_path):
    url = str(tmp_path / "report")
    reports.render_report_md(url)  # evaluate never got that far
    assert not exists(join(url, "report.md"))
    write_bytes_atomic(join(url, "report.json"), b"{not json")
    reports.render_report_md(url)
    assert not exists(join(url, "report.md"))


# -- earlier reports are untrusted input (issue 37 item 4, review finding 10) -----------------------------------

@pytest.mark.parametrize("damage", [
    lambda r: r["runs"]["distributed"].update(tokens_per_s="9000"),  # the review's reproduction: TypeError
    lambda r: r.update(config=[1]),  # AttributeError: 'list' object has no attribute 'get'
    lambda r: r.update(hardware={"distributed": "gpu-a"}),
    lambda r: r["runs"]["distributed"].update(tokens_per_s=10 ** 400),
    lambda r: r["runs"]["distributed"].update(num_workers=True),
    lambda r: r.update(created_at=None),
    lambda r: r["comparison"].update(efficiency=float("nan")),
])
def test_an_odd_earlier_report_is_left_out_and_never_fails_the_throughput_watch(tmp_path, caplog, damage):
    from tasks.report import throughput

    runs_url = str(tmp_path / "runs")
    cfg = {"num_workers": 2, "backend": "local", "model": "tiny"}
    good, odd = report("good", 2, 0.9), report("odd", 2, 0.9)
    for data in (good, odd):
        data.update(config=cfg, created_at="2026-12-01T00:00:00+00:00")
    damage(odd)
    write_json_atomic(join(runs_url, "good-1", "report", "report.json"), good)
    write_json_atomic(join(runs_url, "odd-1", "report", "report.json"), odd)
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.report"):
        earlier = reports.earlier_reports(runs_url, exclude_run_key="new-2")
    assert [r.run_id for r in earlier] == ["good"] and "odd-1/report/report.json" in caplog.text

    new = report("new", 2, 0.9)
    new.update(config=cfg)
    new["runs"]["distributed"]["tokens_per_s"] = 1.0
    assert throughput.assess(document_of(new), earlier, 0.5).warnings  # compared with the good one, and it ran


def test_an_earlier_report_too_large_or_too_deep_is_left_out_unread(tmp_path, monkeypatch, caplog):
    from tasks.report import untrusted as report_file

    runs_url = str(tmp_path / "runs")
    write_bytes_atomic(join(runs_url, "deep-1", "report", "report.json"), b"[" * 100000)
    write_bytes_atomic(join(runs_url, "nested-1", "report", "report.json"), b"[" * 40 + b"]" * 40)
    write_json_atomic(join(runs_url, "big-1", "report", "report.json"), {**report("big", 2, 0.5), "pad": "x" * 5000})
    monkeypatch.setattr(report_file, "MAX_RECORD_BYTES", 4096)
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.report"):
        assert reports.earlier_reports(runs_url, exclude_run_key="new-2") == []
    assert "nested too deep" in caplog.text and "too large" in caplog.text


def test_an_earlier_report_with_keys_of_a_later_version_is_read_and_written_back_with_them(tmp_path, caplog):
    """Fields this version does not model stay in `extra`; fields added since the first reports default."""
    runs_url = str(tmp_path / "runs")
    later = {**report("later", 2, 0.5), "carbon": {"kg": 0.1}}
    later["runs"]["distributed"]["energy_j"] = 12.5
    write_json_atomic(join(runs_url, "later-1", "report", "report.json"), later)
    with caplog.at_level(logging.WARNING, logger="gpt_finetune.report"):
        (read,) = reports.earlier_reports(runs_url, exclude_run_key="new-2")
    assert caplog.text == "" and read.extra == {"carbon": {"kg": 0.1}}
    assert read.runs.distributed.extra == {"energy_j": 12.5} and read.samples == () and read.prediction is None
    written = read.to_json()
    assert written["carbon"] == {"kg": 0.1} and written["runs"]["distributed"]["energy_j"] == 12.5


def test_a_mistyped_or_missing_field_is_refused_naming_the_file_and_the_field():
    data = report()
    data["runs"]["baseline"]["eval_loss"] = "5.30"
    with pytest.raises(ReportError, match=r"^report.json: runs.baseline.eval_loss: expected float, got str '5.30'"):
        document_of(data)
    data = report()
    data["gates"][0]["passed"] = 1
    with pytest.raises(ReportError, match=r"^report.json: gates\[0\].passed: expected bool, got int 1"):
        document_of(data)
    data = report()
    del data["runs"]["distributed"]["model_url"]
    with pytest.raises(ReportError, match=r"^report.json: runs.distributed: missing key\(s\) model_url"):
        document_of(data)
    with pytest.raises(ReportError, match=r"^report.json: the report: expected a JSON object, got list"):
        document_of([])
    data = report()
    data["runs"]["distributed"]["tokens_per_s"] = 10 ** 400
    with pytest.raises(ReportError, match=r"runs.distributed.tokens_per_s: expected float, got int"):
        document_of(data)
