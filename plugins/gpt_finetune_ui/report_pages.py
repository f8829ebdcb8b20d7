"""The report pages as HTML: the index of runs and promoted models, and one run's report, written from the same
view as its report.md (tasks/report/view.py).

Every value from storage goes through `_text` or `_fmt`, which escape it whatever its type; a chart is linked only
under a plain file name (runs_data.CHART_FILE).
"""

from __future__ import annotations

import html
from typing import Any

from core.protocol import RUN_KEY_PATTERN
from gpt_finetune_ui.runs_data import CHART_FILE
from tasks.report import blocks
from tasks.report import view as report_view
from tasks.report.formatting import fmt, known_words
from tasks.report.parts import RunView

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #1b1f24; }
table { border-collapse: collapse; margin: 0.8rem 0; }
th, td { border: 1px solid #d0d7de; padding: 0.35rem 0.7rem; text-align: right; }
th { background: #f6f8fa; } td { white-space: nowrap; } td:first-child, th:first-child { text-align: left; }
th.prose, td.prose { white-space: normal; text-align: left; max-width: 30rem; }
.pass { color: #1a7f37; font-weight: 600; } .fail { color: #cf222e; font-weight: 600; }
.note { color: #57606a; max-width: 60rem; } img { max-width: 100%; border: 1px solid #d0d7de; margin: 0.5rem 0; }
.warning { color: #9a6700; background: #fff8c5; border: 1px solid #d4a72c; padding: 0.5rem 1.5rem; max-width: 60rem; }
"""


def _text(value: Any) -> str:
    return "—" if value is None else html.escape(str(value))


def _fmt(value: Any, spec: str, suffix: str = "", scale: float = 1) -> str:
    return html.escape(fmt(value, spec, suffix, scale))


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{body}</body></html>")


def _status(status: str) -> str:
    css = {"passed": "pass", "yes": "pass", "failed": "fail", "no": "fail"}.get(status, "note")
    return f"<span class='{css}'>{_text(status)}</span>"


# ---------------------------------------------------------------------------------------------------------------
# the index: every run's headline figures and the promoted models


def _usage_cells(run: dict[str, Any]) -> str:
    """GPU-h held, busy share, cost (blank without a price, never 0) and time to release."""
    cost = "" if run.get("cost") is None else f"{_fmt(run['cost'], '.4g')} {_text(run.get('currency') or '')}"
    return (f"<td>{_fmt(run.get('held_gpu_h'), '.3f')}</td><td>{_fmt(run.get('busy_share'), '.0f', '%', scale=100)}"
            f"</td><td>{cost}</td><td>{_fmt(run.get('time_to_release_s'), '.1f', ' s')}</td>")


def render_index(runs: list[dict[str, Any]], root: str, *, models: list[dict[str, Any]] | None = None) -> str:
    header = ("<tr><th>run</th><th>gates</th><th>released</th><th>workers</th><th>speedup</th><th>efficiency</th>"
              "<th>tokens/s</th><th>train time</th><th>eval loss</th><th>baseline eval loss</th>"
              "<th title='share of the words in the distributed model's greedy / top-k samples that occur in the "
              "training text'>known words</th><th>GPU-h held</th><th>busy</th><th>cost</th>"
              "<th title='from the last worker's exit to release's proof that its GPUs are free'>time to release</th>"
              "<th>created</th></tr>")
    rows = []
    for run in runs:
        if "created_at" not in run:  # nothing to show: no link to a page that would say so
            rows.append(f"<tr><td>{_text(run['run_id'])}</td><td>{_status(run['status'])}</td>"
                        f"<td>{_status(run['released'])}</td><td colspan='13'></td></tr>")
            continue
        link = f"<a href='runs/{_text(run['run_key'])}/'>{_text(run['run_id'])}</a>"
        rows.append(
            f"<tr><td>{link}</td><td>{_status(run['status'])}</td><td>{_status(run['released'])}</td>"
            f"<td>{_text(run['num_workers'])}</td>"
            f"<td>{_fmt(run['speedup'], '.2f', 'x')}</td><td>{_fmt(run['efficiency'], '.0f', '%', scale=100)}</td>"
            f"<td>{_fmt(run['tokens_per_s'], ',.0f')}</td><td>{_fmt(run['train_time_s'], '.1f', ' s')}</td>"
            f"<td>{_fmt(run['eval_loss'], '.4f')}</td><td>{_fmt(run['baseline_eval_loss'], '.4f')}</td>"
            f"<td>{html.escape(known_words(run['known_words']))}</td>{_usage_cells(run)}"
            f"<td>{_text(run['created_at'])}</td></tr>"
        )
    table = f"<table id='runs'>{header}{''.join(rows)}</table>" if rows else "<p>No runs yet.</p>"
    return _page("GPT fine-tune runs", f"<h1>GPT fine-tune runs</h1><p class='note'>Storage root: "
                                       f"<code>{_text(root)}</code></p>{table}"
                                       + (render_models(models) if models is not None else ""))


def _run_link(run_key: Any, text: Any, prefix: str = "") -> str:
    """A link to a run's page when `run_key` is a run key, else the text alone."""
    if isinstance(run_key, str) and RUN_KEY_PATTERN.fullmatch(run_key):
        return f"<a href='{prefix}runs/{html.escape(run_key)}/'>{_text(text)}</a>"
    return _text(text)


def render_models(models: list[dict[str, Any]]) -> str:
    """Per registered model: which run produced `latest`, and the version history with links to the reports."""
    if not models:
        return "<h2>Promoted models</h2><p>No model promoted yet.</p>"
    parts = ["<h2>Promoted models</h2>"]
    for model in models:
        name = _text(model["name"])
        if "error" in model:
            parts.append(f"<p class='fail'>{name}: {_text(model['error'])}</p>")
            continue
        parts.append(
            f"<p class='latest' id='latest-{name}'>{name}: latest is <b>{_text(model['latest'])}</b>, produced by "
            f"run {_run_link(model['run_key'], model['run_id'])} on {_text(model['promoted_at'])} "
            f"(eval loss {_fmt(model['eval_loss'], '.4f')})</p>"
            f"<table class='history' id='history-{name}'><tr><th>version</th><th>promoted</th><th>eval loss</th>"
            "<th>run report</th></tr>"
            + "".join(f"<tr><td>{_text(entry['version'])}</td><td>{_text(entry['promoted_at'])}</td>"
                      f"<td>{_fmt(entry['eval_loss'], '.4f')}</td>"
                      f"<td>{_run_link(entry['run_key'], entry['run_id'])}</td></tr>" for entry in model["history"])
            + "</table>")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# one run's report


def render_run(report: RunView) -> str:
    """The run's page: every section of its report view."""
    view = report_view.report_view(report)
    body = [f"<p><a href='../../'>All runs</a></p><h1>{_line(view.title)}</h1>"]
    for section in view.sections:
        body += [f"<h2>{html.escape(section.title)}</h2>"] if section.title else []
        body += [_block(block) for block in section.blocks]
    return _page("".join(mark if isinstance(mark, str) else mark.text for mark in view.title), "".join(body))


def _block(block: blocks.Block) -> str:
    if isinstance(block, blocks.Paragraph):
        return f"<p{_id(block.anchor)}>{_line(block.line)}</p>"
    if isinstance(block, blocks.Bullets):
        return "<ul class='note'>" + "".join(f"<li{_id(item.anchor)}>{_line(item.line)}</li>"
                                             for item in block.items) + "</ul>"
    if isinstance(block, blocks.Warnings):
        items = "".join(f"<li>{_text(text)}</li>" for text in block.texts)
        return f"<ul id='warnings' class='warning'>{items}</ul>"
    if isinstance(block, blocks.Charts):
        return "".join(f"<img alt='{_text(name)}' src='charts/{_text(file)}'>" for name, file in block.files
                       if CHART_FILE.fullmatch(file))
    return _table(block)


def _table(table: blocks.Table) -> str:
    def cell(tag: str, column: str, content: str) -> str:
        return f"<{tag} class='prose'>{content}</{tag}>" if column in table.prose else f"<{tag}>{content}</{tag}>"

    header = "".join(cell("th", column, html.escape(column)) for column in table.columns)
    rows = "".join("<tr>" + "".join(cell("td", column, _mark(mark)) for column, mark in zip(table.columns, row))
                   + "</tr>" for row in table.rows)
    return f"<table{_id(table.anchor)}><tr>{header}</tr>{rows}</table>"


def _line(line: blocks.Line) -> str:
    return "".join(_mark(mark) for mark in line)


def _mark(mark: blocks.Mark) -> str:
    if isinstance(mark, blocks.Emphasis):
        return f"<b>{_text(mark.text)}</b>"
    if isinstance(mark, blocks.Code):
        return f"<code>{_text(mark.text)}</code>"
    if isinstance(mark, blocks.Verdict):
        css = {True: "pass", False: "fail"}.get(mark.passed, "note")
        label = f"{_text(mark.label)}: " if mark.label else ""
        return f"{label}<span class='{css}'{_id(mark.anchor)}>{_text(mark.text)}</span>"
    return _text(mark)


def _id(anchor: str | None) -> str:
    return f" id='{anchor}'" if anchor else ""
