"""The comparison report: the figures table, the history of runs, and writing them (evaluate: report.json and the
charts, tasks/report/charts.py; release: report.md, from the report's view, tasks/report/view.py, of the three parts).

`report.json` is written last under `<root>/runs/<run_key>/report/`: readers (the UI plugin, later runs' history
charts) trust a report only once it exists. It is tasks/report/document.py's `RunReport` (each record's docstring
lists its fields), read back checked. The layout of `report.json` (format_version 1):

    {"format_version", "run_id", "run_key", "created_at", "num_workers", "gates_passed",
     "runs": {"distributed": RUN, "baseline": RUN | null},
     "comparison": {"speedup", "efficiency", "loss_delta", "loss_delta_se", "loss_tolerance"} (null figures without
                    a baseline; loss_delta_se: the delta's standard error, paired over the sample's sequences),
     "gates": [{"name", "passed", "value", "limit", "detail"}],
     "baseline": {"policy", "key", "url", "trained_by_run", "reused"},
     "hardware": {"line", "distributed", "baseline", "task_host"}, "versions": {...}, "config": {...},
     "eval_sample": SAMPLE (what every model of the run was scored on),
     "table": [ROW], "charts": {"loss_curves": "loss_curves.png", "scaling": "scaling.png"},
     "segments": [SEGMENT], "elastic": bool (tasks/report/scaling.py: each launch of train, fewer workers than asked),
     "prediction": {"num_workers", "predicted_speedup", "measured_speedup", "predicted_efficiency",
                    "measured_efficiency", "speedup_error", "recommendation", "rows", "step_source"} | null,
     "warnings": [sentence] (tasks/report/throughput.py: tokens/s well below the prediction or the last comparable run),
     "release": {"clean", "released_at", "host", "survivors"} (release.json's, folded in by tasks/report/parts.py),
     "continued_from": {"name", "version", "url", "model_url", "run_id", "eval_loss"} | null,
     "promoted": {"name", "version", "url", "run_id", "recorded_eval_loss", "recorded_eval_loss_se",
                  "recorded_eval_sample", "eval_loss", "eval_loss_se", "eval_sample" (id), "delta_se" (of the run's
                  loss minus this one, paired), "perplexity", "nats_per_char", "known_words", "samples", "note"}
                 | null (the promoted version when evaluate ran, scored on this run's shards),
     "samples": [{"model": label, "eval_loss", "nats_per_char", "known_words": KNOWN,
                  "samples": [{"prompt", "greedy", "top_k"}]}],
     "promotion": {"promoted", "policy", "model_name", "reason", "compared_with", "version", "url", "model_url",
                   "decided_at"} (promotion.json's, folded in by tasks/report/parts.py)}
    RUN = {"label", "num_workers", "global_batch_size", "steps", "tokens_seen", "train_time_s", "wall_time_s",
           "tokens_per_s", "final_loss", "mfu", "eval_loss", "perplexity", "nats_per_char", "known_words": KNOWN,
           "eval_tokens", "eval_time_s", "model_url", "summary_url", "started_at", "finished_at",
           "gpu_mem_peak_mb", "gpu_mem_reserved_mb" (rank 0's GPU, from summary.json; null on CPU),
           "memory" (rank 0's forecast beside its measured peak, summary.json's `memory`; null before it),
           "release_after_train_s" (seconds from the training group's exit to the proof that its slots were free,
           from its state record's "after_exit"; null when not proven then or not trained by this run),
           "eval_loss_se" (standard error over the sample's sequences as an estimate of the split's loss: 0 for the
           whole split), "eval_sample": SAMPLE}
    SAMPLE = {"id", "tokens", "split_tokens", "sequences", "split_sequences", "whole_split", "asked_tokens" (the
              setting eval_tokens), "workers" (that scored it), "read_bytes"} (trainer/eval_sample.py)
    KNOWN = {"greedy", "top_k": share of the sample words found in the training text, "words": {"greedy", "top_k"}}
           (core/text_quality.py; null in reports of evaluations that predate it)
"""

from __future__ import annotations

import logging
from typing import Any

from core.layout import REPORT_JSON
from core.storage import exists, join, list_dir, write_bytes_atomic, write_json_atomic
from tasks.report.document import ReportError, RunReport
from tasks.report.formatting import TABLE_COLUMNS
from tasks.report.markdown import markdown
from tasks.report.parts import RunView, read_parts, run_view
from tasks.report.untrusted import UnreadableRecord, finite, read_record
from tasks.report.view import report_view

log = logging.getLogger("gpt_finetune.report")

REPORT_FORMAT_VERSION = 1
REPORT_MD = "report.md"
LOSS_CHART = "loss_curves.png"
SCALING_CHART = "scaling.png"


def text_table(rows: list[dict[str, str]]) -> str:
    """The table as aligned plain text, for the task log."""
    widths = {col: max(len(col), *(len(row[col]) for row in rows)) for col in TABLE_COLUMNS}
    lines = [" | ".join(col.ljust(widths[col]) for col in TABLE_COLUMNS),
             "-+-".join("-" * widths[col] for col in TABLE_COLUMNS)]
    lines += [" | ".join(row[col].ljust(widths[col]) for col in TABLE_COLUMNS) for row in rows]
    return "\n".join(lines)


def render_markdown(view: RunView) -> str:
    return markdown(report_view(view))


# ---------------------------------------------------------------------------------------------------------------
# history and writing


def history_point(report: RunReport) -> list[dict[str, Any]]:
    """The scaling points one report contributes: its distributed run, and its baseline as the N=1 point."""
    return [{"run_id": report.run_id, "num_workers": run.num_workers, "tokens_per_s": run.tokens_per_s,
             "efficiency": 1.0 if run is report.runs.baseline else report.comparison.efficiency}
            for run in report.runs.trained()]


def earlier_reports(runs_url: str, *, exclude_run_key: str) -> list[RunReport]:
    """Every other run's report.json that reads as a report: within the size and depth limits of any record read
    back (tasks/report/untrusted.py), every field of its type (tasks/report/document.py) and its figures plausible
    (`check_earlier`). Others are logged and left out: another run's odd report never fails this run's evaluate."""
    found = []
    for key in list_dir(runs_url):
        url = join(runs_url, key, "report", REPORT_JSON)
        if key == exclude_run_key or not exists(url):
            continue
        try:
            report = RunReport.from_json(read_record(url), url)
            check_earlier(report, url)
        except Exception as error:  # noqa: BLE001 - storage errors too: the history is best effort
            log.warning("Leaving %s out of the history: it is not a readable report (%s).", url, error)
            continue
        found.append(report)
    return found


def check_earlier(report: RunReport, url: str) -> None:
    """ReportError naming the first figure the history (`history_point`), the scaling chart and the throughput watch
    (tasks/report/throughput.py) read of an earlier report that is of its type but no figure they can use."""
    for name, run in (("baseline", report.runs.baseline), ("distributed", report.runs.distributed)):
        if run is None:  # no baseline: nothing read
            continue
        if run.num_workers < 1:
            raise ReportError(url, f"runs.{name}.num_workers", f"{run.num_workers} is not a worker count")
        if run.tokens_per_s is not None and (not finite(run.tokens_per_s) or run.tokens_per_s <= 0):  # null: not timed
            raise ReportError(url, f"runs.{name}.tokens_per_s", f"{run.tokens_per_s} is not a positive number")
    efficiency = report.comparison.efficiency  # null: no baseline
    if efficiency is not None and not finite(efficiency):
        raise ReportError(url, "comparison.efficiency", f"{efficiency} is not a number")


def write_report(report_url: str, report: RunReport, charts: dict[str, bytes]) -> str:
    """Evaluate's report: the charts first, report.json last (its presence marks a complete report); returns its URL.
    report.md is release's (`render_report_md`): written once every part beside report.json is final."""
    for name, png in charts.items():
        write_bytes_atomic(join(report_url, name), png)
    json_url = join(report_url, REPORT_JSON)
    write_json_atomic(json_url, report.to_json())
    return json_url


def render_report_md(report_url: str) -> None:
    """report.md from the three parts (report.json, promotion.json, release.json; tasks/report/parts.py merges
    them): the release task's, report.md's one writer. Nothing before evaluate wrote report.json (an unreadable or
    mistyped one writes nothing: the run's page says why)."""
    json_url = join(report_url, REPORT_JSON)
    if not exists(json_url):
        return
    try:
        report = RunReport.from_json(read_record(json_url), json_url)
    except (UnreadableRecord, ReportError, OSError) as error:
        log.warning("Not rendering report.md: %s", error)
        return
    write_bytes_atomic(join(report_url, REPORT_MD),
                       render_markdown(run_view(report, *read_parts(report_url))).encode("utf-8"))
