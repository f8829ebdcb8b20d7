"""What the report pages read from storage: each run's report (report.json with promotion.json and release.json
beside it, read as one by tasks/report/parts.py) and charts, and the model registry's latest.json
(tasks/registry.py), through `core.storage`, so local disk and S3 read alike.

Nothing read here is trusted (many tasks can write storage): run keys and chart names are matched whole before
they become paths, an index row checks the type of every field it shows, and errors name runs, never storage URLs.
A report or release record over the size or depth limits of tasks/report/untrusted.py reads as unreadable: on the index
as an error row (one run's record never fails the page), on its run page as 422. A promotion or release record that
cannot be read leaves the report readable: the page says which part it could not read.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from core.layout import StorageLayout
from core.protocol import RUN_KEY_PATTERN
from core.storage import exists, join, list_dir, read_bytes
from tasks.registry import read_latest
from tasks.report.document import ReportError, RunReport
from tasks.report.parts import RunView, read_part, read_parts, released, run_view
from tasks.report.untrusted import UnreadableRecord, finite, read_record

log = logging.getLogger("gpt_finetune.ui")

CHART_FILE = re.compile(r"[A-Za-z0-9_-]{1,100}\.png")
NUMBER = (int, float)


class NotFound(LookupError):
    """No such run, no report yet, or no such chart (HTTP 404)."""


class UnreadableReport(ValueError):
    """A report.json that is no JSON object (HTTP 422)."""


class FieldError(ValueError):
    """A figure of the GPU-time ledger an index row shows that is missing or has the wrong type."""


def report_dir(storage: StorageLayout, run_key: str) -> str:
    if not RUN_KEY_PATTERN.fullmatch(run_key):
        raise NotFound("No such run")
    return storage.run(run_key).report


def read_report(storage: StorageLayout, run_key: str) -> RunView:
    """The run's report with its promotion and release parts; UnreadableReport naming the field when report.json is
    not one (tasks/report/document.py), NotFound before evaluate wrote it."""
    url = join(report_dir(storage, run_key), "report.json")
    if not exists(url):
        raise NotFound(f"Run {run_key} has no report: its evaluate task has not finished.")
    try:
        report = RunReport.from_json(read_record(url), "report.json")
    except (UnreadableRecord, OSError) as error:
        log.warning("Run %s: unreadable report %s (%s)", run_key, url, error)
        raise UnreadableReport(f"Run {run_key} has an unreadable report.") from error
    except ReportError as error:
        log.warning("Run %s: %s is not a report (%s)", run_key, url, error)
        raise UnreadableReport(f"Run {run_key} has an unreadable report: {error.brief}") from error
    return run_view(report, *read_parts(report_dir(storage, run_key)))


def read_chart(storage: StorageLayout, run_key: str, name: str) -> bytes:
    """A chart the run's report names (no other file of the report directory)."""
    charts = read_report(storage, run_key).report.charts
    if not CHART_FILE.fullmatch(name) or name not in charts.values():
        raise NotFound(f"Run {run_key} has no such chart")
    url = join(report_dir(storage, run_key), name)
    if not exists(url):
        raise NotFound(f"Run {run_key}: chart {name} is missing")
    return read_bytes(url)


def _if_present(record: Any, path: str, kind: type | tuple[type, ...], *, within: str) -> Any:
    """`record[a][b]...` for `path` "a.b...", checked to be of `kind` (numbers: int or float, never bool, finite); a
    field that is absent, or under a null (a run without usage, cost or price), reads None. FieldError names
    `within`.`path` otherwise."""
    value = record
    for part in path.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return None
        value = value[part]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):  # bool is an int subclass
        raise FieldError(f"field '{within}.{path}' is a {type(value).__name__}")
    if kind is NUMBER and not finite(value):  # a 401-digit integer once made the index a 500 (OverflowError)
        raise FieldError(f"field '{within}.{path}' is not a finite number")
    return value


def headline(key: str, view: RunView) -> dict[str, Any]:
    """The index row of one report; FieldError when a figure of the ledger it shows is of the wrong type."""
    report = view.report
    distributed, baseline = report.runs.distributed, report.runs.baseline
    known = distributed.known_words or {}
    return {
        "run_key": key,
        "run_id": report.run_id,
        "status": "passed" if report.gates_passed else "failed",
        "created_at": report.created_at,
        "num_workers": report.num_workers,
        "speedup": report.comparison.speedup,
        "efficiency": report.comparison.efficiency,
        "tokens_per_s": distributed.tokens_per_s,
        "train_time_s": distributed.train_time_s,
        "eval_loss": distributed.eval_loss,
        "baseline_eval_loss": baseline.eval_loss if baseline else None,
        "known_words": {mode: _if_present(known, mode, NUMBER, within="runs.distributed.known_words")
                        for mode in ("greedy", "top_k")},
        # GPU time and cost (release adds `usage`; a report without it lists with blanks)
        **{name: _if_present(view.usage, path, kind, within="usage") for name, path, kind in (
            ("held_gpu_h", "held_gpu_h", NUMBER), ("busy_share", "busy_share", NUMBER), ("cost", "cost.held", NUMBER),
            ("currency", "price.currency", str), ("time_to_release_s", "time_to_release_s", NUMBER))},
        "released": view.released,
    }


def list_runs(storage: StorageLayout) -> list[dict[str, Any]]:
    """Headline figures of every run with a report, newest first; runs without one are listed as pending, runs
    whose report cannot be read or has wrong types as an error row."""
    runs = []
    for key in list_dir(storage.runs):
        url = join(storage.run(key).report, "report.json")
        release = read_part(storage.run(key).release)  # the GPU-time ledger is release's (release.json)
        if not exists(url):
            runs.append({"run_key": key, "run_id": key, "status": "no report yet", "released": released(release)})
            continue
        try:
            runs.append(headline(key, run_view(RunReport.from_json(read_record(url), "report.json"), None, release)))
        except Exception as error:  # noqa: BLE001 - one run's report, whatever is wrong with it, is one error row
            log.warning("Run %s: unreadable report %s (%s)", key, url, error)
            detail = error.brief if isinstance(error, ReportError) else error if isinstance(error, FieldError) else (
                error.reason if isinstance(error, UnreadableRecord) else "cannot be read")
            runs.append({"run_key": key, "run_id": key, "status": f"unreadable report: {detail}",
                         "released": released(release)})
    # created_at has milliseconds (core.clock.utc_now): runs created within one are ordered by run id.
    return sorted(runs, key=lambda run: (run.get("created_at") or "", run["run_id"]), reverse=True)


def list_models(storage: StorageLayout) -> list[dict[str, Any]]:
    """Every registered model: its latest version, the run that produced it and the version history (newest
    first), from latest.json alone; an unreadable pointer becomes an error entry."""
    models = []
    for name in list_dir(storage.models):
        try:
            pointer = read_latest(storage.model(name))
        except Exception as error:  # noqa: BLE001 - RegistryError, storage errors: one model's error entry
            log.warning("Model %s: unreadable pointer (%s)", name, error)
            models.append({"name": name, "error": "unreadable latest.json"})
            continue
        if pointer is None:  # a claim or a half-written version, never a promotion
            continue
        history = [{field: getattr(entry, field) for field in ("version", "run_id", "run_key", "promoted_at",
                                                               "eval_loss")} for entry in pointer.history]
        models.append({"name": name, "latest": pointer.version, "run_id": pointer.run_id, "run_key": pointer.run_key,
                       "promoted_at": pointer.promoted_at, "eval_loss": pointer.eval_loss, "history": history[::-1]})
    return models
