"""What the report pages read from storage: each run's report (report.json with promotion.json and release.json
beside it, read as one by tasks/report_parts.py) and charts, and the model registry's latest.json
(tasks/registry.py), through `trainer.storage`, so local disk and S3 read alike.

Nothing read here is trusted (many tasks can write storage): run keys and chart names are matched whole before
they become paths, an index row checks the type of every field it shows, and errors name runs, never storage URLs.
A report or release record over the size or depth limits of tasks/report_file.py reads as unreadable: on the index
as an error row (one run's record never fails the page), on its run page as 422. A promotion or release record that
cannot be read leaves the report readable: the page says which part it could not read.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from launcher.protocol import RUN_KEY_PATTERN
from tasks.registry import read_latest
from tasks.report_file import UnreadableRecord, finite, read_record
from tasks.report_parts import read_part, read_parts, run_report
from trainer.layout import StorageLayout
from trainer.storage import exists, join, list_dir, read_bytes

log = logging.getLogger("gpt_finetune.ui")

CHART_FILE = re.compile(r"[A-Za-z0-9_-]{1,100}\.png")
NUMBER = (int, float)


class NotFound(LookupError):
    """No such run, no report yet, or no such chart (HTTP 404)."""


class UnreadableReport(ValueError):
    """A report.json that is no JSON object (HTTP 422)."""


class ReportError(ValueError):
    """A report.json that is not what tasks/report.py writes: a field is missing or has the wrong type."""


def report_dir(storage: StorageLayout, run_key: str) -> str:
    if not RUN_KEY_PATTERN.fullmatch(run_key):
        raise NotFound("No such run")
    return storage.run(run_key).report


def read_report(storage: StorageLayout, run_key: str) -> dict[str, Any]:
    url = join(report_dir(storage, run_key), "report.json")
    if not exists(url):
        raise NotFound(f"Run {run_key} has no report: its evaluate task has not finished.")
    try:
        report = read_record(url)
    except (UnreadableRecord, OSError) as error:
        log.warning("Run %s: unreadable report %s (%s)", run_key, url, error)
        raise UnreadableReport(f"Run {run_key} has an unreadable report.") from error
    if not isinstance(report, dict):
        raise UnreadableReport(f"Run {run_key} has an unreadable report.")
    return run_report(report, *read_parts(report_dir(storage, run_key)))


def read_chart(storage: StorageLayout, run_key: str, name: str) -> bytes:
    """A chart the run's report names (no other file of the report directory)."""
    charts = read_report(storage, run_key).get("charts")
    if not CHART_FILE.fullmatch(name) or not isinstance(charts, dict) or name not in charts.values():
        raise NotFound(f"Run {run_key} has no such chart")
    url = join(report_dir(storage, run_key), name)
    if not exists(url):
        raise NotFound(f"Run {run_key}: chart {name} is missing")
    return read_bytes(url)


def release_status(release_url: str) -> str:
    """yes / no (something of the run outlived its release) / pending (release has not run), from release.json."""
    if not exists(release_url):
        return "pending"
    try:
        record = read_record(release_url)
        return "yes" if isinstance(record, dict) and record.get("clean") is True else "no"
    except Exception as error:  # noqa: BLE001 - e.g. a directory, a list, too large: never a 500 for the index
        log.warning("Unreadable release record %s (%s)", release_url, error)
        return "no"


def _field(report: Any, path: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """`report[a][b]...` for `path` "a.b...", checked to be of `kind` (numbers: int or float, never bool)."""
    value = report
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ReportError(f"field {path!r} is missing")
        value = value[part]
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):  # bool is an int subclass
        raise ReportError(f"field {path!r} is a {type(value).__name__}")
    if kind is NUMBER and not finite(value):  # a 401-digit integer once made the index a 500 (OverflowError)
        raise ReportError(f"field {path!r} is not a finite number")
    return value


def _if_present(report: Any, path: str, kind: type | tuple[type, ...]) -> Any:
    """As `_field`, but a field that is absent, or under a null (a run without usage, cost or price), reads None."""
    value = report
    for part in path.split("."):
        if not isinstance(value, dict) or value.get(part) is None:
            return None
        value = value[part]
    return _field(report, path, kind, optional=True)


def headline(key: str, report: Any) -> dict[str, Any]:
    """The index row of one report; ReportError when a field it shows is missing or of the wrong type."""
    has_baseline = isinstance(report, dict) and isinstance(report.get("runs"), dict) and \
        report["runs"].get("baseline") is not None
    return {
        "run_key": key,
        "run_id": _field(report, "run_id", str),
        "status": "passed" if _field(report, "gates_passed", bool) else "failed",
        "created_at": _field(report, "created_at", str),
        "num_workers": _field(report, "num_workers", int),
        "speedup": _field(report, "comparison.speedup", NUMBER, optional=True),
        "efficiency": _field(report, "comparison.efficiency", NUMBER, optional=True),
        "tokens_per_s": _field(report, "runs.distributed.tokens_per_s", NUMBER, optional=True),
        "train_time_s": _field(report, "runs.distributed.train_time_s", NUMBER, optional=True),
        "eval_loss": _field(report, "runs.distributed.eval_loss", NUMBER, optional=True),
        "baseline_eval_loss": _field(report, "runs.baseline.eval_loss", NUMBER, optional=True) if has_baseline
        else None,
        "known_words": {mode: _field(report, f"runs.distributed.known_words.{mode}", NUMBER, optional=True)
                        for mode in ("greedy", "top_k")},
        # GPU time and cost (release adds `usage`; a report without it lists with blanks)
        "held_gpu_h": _if_present(report, "usage.held_gpu_h", NUMBER),
        "busy_share": _if_present(report, "usage.busy_share", NUMBER),
        "cost": _if_present(report, "usage.cost.held", NUMBER),
        "currency": _if_present(report, "usage.price.currency", str),
        "time_to_release_s": _if_present(report, "usage.time_to_release_s", NUMBER),
    }


def list_runs(storage: StorageLayout) -> list[dict[str, Any]]:
    """Headline figures of every run with a report, newest first; runs without one are listed as pending, runs
    whose report cannot be read or has wrong types as an error row."""
    runs = []
    for key in list_dir(storage.runs):
        url = join(storage.run(key).report, "report.json")
        released = release_status(storage.run(key).release)
        if not exists(url):
            runs.append({"run_key": key, "run_id": key, "status": "no report yet", "released": released})
            continue
        try:
            report = read_record(url)
            if isinstance(report, dict):  # the GPU-time ledger is release's (release.json)
                report = run_report(report, None, read_part(storage.run(key).release))
            runs.append({**headline(key, report), "released": released})
        except Exception as error:  # noqa: BLE001 - one run's report, whatever is wrong with it, is one error row
            log.warning("Run %s: unreadable report %s (%s)", key, url, error)
            detail = error if isinstance(error, ReportError) else error.reason if isinstance(
                error, UnreadableRecord) else "cannot be read"
            runs.append({"run_key": key, "run_id": key, "status": f"unreadable report: {detail}", "released": released})
    # created_at has milliseconds (launcher.protocol.utc_now): runs created within one are ordered by run id.
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
