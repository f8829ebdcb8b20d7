"""The ledger's reads and writes: the launch path's events under `runs/<key>/usage/` (one file per group attempt,
`<group>-<launch time>-a<attempt>.json`, written by tasks/launch.py), the training summaries' step times, the
frozen price (`usage/price.json`, written by prepare) and release's time, into release.json's `usage`
(tasks/ledger/usage.py computes; this module only gathers).

Step ends come from the summaries, not from the workers' clocks: a successful train or baseline attempt trained
`train_time_s` on every rank and its last step ended `finished_at - time of the last metrics line` before the
rank exited (both on the worker's clock, a difference), so only durations cross from the workers' clocks to the
launcher's. An attempt that failed after joining left no summary: its time after the join counts as redone.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar

from core.config.schema import flat_settings
from core.document import Document, DocumentError, checked
from core.protocol import EXIT_PREEMPTED
from core.storage import exists, join, list_dir, read_bytes, read_json, write_json_atomic
from tasks.ledger import airflow_api, usage
from tasks.ledger.airflow_api import AdmissionWait
from tasks.ledger.pricing import Price
from tasks.ledger.summary import AdmissionRow, AttemptRow, LiveWarning, UsageSummary, summarize
from tasks.ledger.usage import STEP_KINDS, AttemptEvents, RankEvents, RankTimeline, Timeline, task_of
from tasks.report import charts
from tasks.report.document import RunFigures, RunReport, Runs

log = logging.getLogger("gpt_finetune.usage")

ATTEMPT_FILE = re.compile(r"-a\d+\.json$")
PRICE_FILE = "price.json"
# The report's run whose summary places the steps of each step kind's attempts.
SUMMARY_OF = {"train": "distributed", "baseline": "baseline"}
D = TypeVar("D", bound=Document)


def usage_dir(run_url: str) -> str:
    return join(run_url, "usage")


def _read(kind: type[D], value: Any, url: str) -> D:
    """`value`, read from `url`, as the document `kind`; DocumentError naming the file and the field otherwise."""
    try:
        return kind.from_xcom(value)
    except DocumentError as error:
        raise DocumentError(f"{url}: {error}") from None


def write_price(run_url: str, price: Price | None) -> None:
    """The price prepare froze (null: no table), kept with the run so that a later table does not reprice it."""
    write_json_atomic(join(usage_dir(run_url), PRICE_FILE), {"price": price.to_xcom() if price else None})


def read_price(run_url: str) -> Price | None:
    """The run's frozen price; None without one (no table, or a run from before the ledger). A file that is not
    `{"price": PRICE | null}` is refused, naming it and the field."""
    url = join(usage_dir(run_url), PRICE_FILE)
    if not exists(url):
        return None
    stored = read_json(url)
    if not isinstance(stored, dict) or set(stored) != {"price"}:
        raise DocumentError(f"{url}: expected {{\"price\": PRICE | null}} (written by prepare), got "
                            f"{type(stored).__name__} {sorted(stored) if isinstance(stored, dict) else ''}: "
                            "refusing it.")
    return None if stored["price"] is None else _read(Price, stored["price"], url)


def load_attempts(run_url: str) -> list[AttemptEvents]:
    """Every group attempt the launch path recorded, by launch time; a file that is not one is refused (naming it
    and the field)."""
    folder = usage_dir(run_url)
    if not exists(folder):
        return []
    attempts = [_read(AttemptEvents, read_json(join(folder, name)), join(folder, name))
                for name in list_dir(folder) if ATTEMPT_FILE.search(name)]
    return sorted(attempts, key=lambda a: min((r.launch for r in a.ranks), default=0.0))


def _seconds_after_last_step(run: RunFigures) -> float:
    """Worker clock: from the last step's metrics line to the summary (export, saving); 0 when unknown."""
    try:
        metrics_url = join(run.summary_url.rsplit("/", 1)[0], "metrics", "rank-0.jsonl")
        last = json.loads(read_bytes(metrics_url).decode().strip().splitlines()[-1])["time"]
        return max(0.0, datetime.fromisoformat(str(run.finished_at)).timestamp() - float(last))
    except Exception as error:  # noqa: BLE001 - a position, not an amount: busy is the summary's either way
        log.info("no last-step time for %s (%s): its steps are placed right before the exit", run.label, error)
        return 0.0


def add_steps(attempts: Sequence[AttemptEvents], runs: Runs | None) -> list[Timeline]:
    """The attempts' timelines with the steps of train and baseline attempts placed: the last successful one's from
    its summary (`runs`: report.json's runs), every earlier failed one's as redone after its join."""
    last_good = {a.kind: a for a in attempts if a.state == "succeeded"}  # by launch time: the last one stays
    timelines = []
    for attempt in attempts:
        ranks = Timeline.of(attempt).ranks
        if attempt.kind in STEP_KINDS:
            run = getattr(runs, SUMMARY_OF[attempt.kind]) if runs else None
            if attempt is last_good.get(attempt.kind) and run:
                after, trained = _seconds_after_last_step(run), float(run.train_time_s)
                ranks = tuple(RankTimeline(rank, first_step_end=rank.exit - after - trained,
                                           last_step_end=rank.exit - after) for rank in attempt.ranks)
            elif attempt.joined is not None and attempt.state != "succeeded":
                ranks = _failed_attempt_steps(attempt.ranks, attempt.joined)
        timelines.append(Timeline(attempt.kind, ranks))
    return timelines


def _failed_attempt_steps(ranks: Sequence[RankEvents], joined: float) -> tuple[RankTimeline, ...]:
    """A failed attempt's time after its join is redone, unless every rank exited EXIT_PREEMPTED: each saved the
    checkpoint of its last step on SIGTERM and the next attempt resumed there, so its steps are kept (busy) and
    nothing is redone (its first step's tracing and the save count as busy too: no summary splits them off)."""
    preempted = bool(ranks) and all(rank.exit_code == EXIT_PREEMPTED for rank in ranks)
    return tuple(RankTimeline(rank, first_step_end=joined, last_step_end=rank.exit,
                              redone_after=None if preempted else joined) for rank in ranks)


@dataclass(frozen=True)
class Admission:
    """The GPU tasks' admission waits from Airflow (tasks/ledger/airflow_api.py), or None with `note` saying why not."""

    waits: tuple[AdmissionWait, ...] | None
    note: str | None = None


def admission(attempts: Sequence[AttemptEvents], dag_id: str | None, run_id: str | None) -> Admission:
    """The admission waits of the tasks that launched `attempts`. Never raises: without them `waited` is null,
    never 0."""
    if not attempts:
        return Admission(None, "no GPU task recorded")
    if not dag_id or not run_id:
        return Admission(None, "not asked: release did not name the DAG run")
    try:
        tries = airflow_api.task_tries(dag_id, run_id, {task_of(a.group) for a in attempts})
    except airflow_api.ApiUnavailable as error:
        log.info("admission waits not measured: %s", error)
        return Admission(None, f"not measured: {error}")
    return Admission(tuple(airflow_api.admission_waits(tries)))


def run_usage(run_url: str, report: RunReport, released_at: str,
              waits: Admission | None = None) -> UsageSummary | None:
    """release.json's `usage`, or None when the run recorded no events (a run from before the ledger). `waits`: the
    GPU tasks' admission waits (`admission`); without them `waited_s` is null and `waited_note` says why."""
    attempts = load_attempts(run_url)
    if not attempts:
        return None
    waits = waits or Admission(None, "not asked")
    admitted = waits.waits
    not_held = [(w.scheduled, w.queued) for w in admitted or () if w.queued > w.scheduled]
    book = usage.ledger(add_steps(attempts, report.runs), datetime.fromisoformat(released_at).timestamp(), not_held)
    hardware = (report.hardware.distributed if report.hardware else None) or {}
    tokens = sum(run.tokens_seen for run in report.runs.trained()) or None
    summary = summarize(book, price=read_price(run_url), accelerator=hardware.get("gpu"), tokens=tokens,
                        efficiency=report.comparison.efficiency)
    return replace(
        summary,
        attempts=tuple(AttemptRow(a.group, a.attempt, a.try_number, a.state, len(a.ranks)) for a in attempts),
        workers=report.runs.distributed.num_workers,
        # Admission waits (Airflow's scheduled -> queued per try of a GPU task): shown, never charged; the part of
        # them between two of the run's groups is left out of held (`waited_gpu_h`, per slot `waited_h`).
        waited_s=round(sum(w.waited_s for w in admitted), 3) if admitted is not None else None,
        waited_note=waits.note,
        admission=tuple(AdmissionRow(w.task_id, w.try_number, w.map_index, w.waited_s, w.queued_s)
                        for w in admitted or ()),
        # The live idle-held warnings (tasks/launch.py, launcher/idle.py), each already logged, counted and mailed.
        idle_warnings=tuple(LiveWarning(a.group, a.attempt, warning) for a in attempts for warning in a.idle_warnings),
        # Groups stopped for holding their slots idle (`reclaim_idle_after_s`): what each had held idle by then.
        reclaims=tuple(LiveWarning(a.group, a.attempt, a.reclaimed) for a in attempts if a.reclaimed),
        reclaimed_gpu_h=round(sum(len(a.reclaimed.slots) * a.reclaimed.idle_s for a in attempts if a.reclaimed)
                              / 3600, 6))


USAGE_CHART = "usage.png"
CAUSE_COLORS = {"busy": "#2e7d32", "between_tasks": "#bdbdbd", "startup": "#90caf9", "stragglers": "#ffb74d",
                "preflight": "#ce93d8", "compile": "#64b5f6", "redone": "#e57373", "evaluation": "#4db6ac",
                "export": "#a1887f", "release": "#616161", "other": "#fff176"}


def usage_chart(summary: UsageSummary) -> bytes:
    """One stacked bar per slot: its held hours by cause, training first."""
    plot = charts.pyplot()
    figure, axes = plot.subplots(figsize=(9, 1.8 + 0.45 * max(1, len(summary.per_slot_by_cause))))
    names = [row.slot for row in summary.per_slot_by_cause]
    left = [0.0] * len(names)
    for cause, color in CAUSE_COLORS.items():
        widths = [row.hours.get(cause, 0.0) * 3600 for row in summary.per_slot_by_cause]
        if any(widths):
            axes.barh(names, widths, left=left, color=color, label=cause.replace("_", " "))
            left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.set_xlabel("seconds held")
    axes.set_title("Held time by cause")
    axes.invert_yaxis()
    axes.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the bars, not over the axis
    return charts.png(plot, figure)


MOSTLY_IDLE_MIN_HELD_H = 1.0  # a run is called mostly idle only from this many held hours (gpuledger's rule)


def cost_warnings(summary: UsageSummary, cfg: Mapping[str, Any]) -> list[str]:
    """The warnings of a finished run's usage (never failures): each idle-held warning raised while a group ran
    (slots held without step progress past `max_idle_held_s`, checked live) and each reclaim, slow release, a mostly
    idle run, extra workers that cost more than `min_cost_efficiency` allows."""
    found = [live.warning.text for live in (*summary.idle_warnings, *summary.reclaims)]
    limit = cfg.get("max_release_s") or 0
    if limit and (summary.time_to_release_s or 0) > limit:
        found.append(f"GPU time: the GPUs were free {summary.time_to_release_s:.0f} s after the last worker "
                     f"exited, more than max_release_s = {limit} s.")
    share, unit = summary.busy_share, summary.unit_name
    if share is not None and share < 0.5 and summary.held_gpu_h >= MOSTLY_IDLE_MIN_HELD_H:
        top = max(summary.idle_by_cause_gpu_h.items(), key=lambda item: item[1])
        found.append(f"GPU time: the run was mostly idle: {share:.0%} of its {summary.held_gpu_h:.3g} held "
                     f"{unit}-h trained; the largest idle cause is {top[0].replace('_', ' ')} ({top[1]:.3g} {unit}-h).")
    floor, efficiency = cfg.get("min_cost_efficiency") or 0, summary.efficiency
    if floor and efficiency is not None and efficiency < floor:
        cheapest = summary.cheapest_workers
        found.append(f"GPU time: at {efficiency:.0%} scaling efficiency the {summary.workers} workers used "
                     f"{1 / efficiency:.1f}x the {unit}-hours per token of one (min_cost_efficiency = "
                     f"{floor:g})" + (f"; the advisor's cheapest count is {cheapest}." if cheapest else "."))
    return found


def _cheapest_workers(report_url: str) -> int | None:
    """The worker count preflight's advisor found cheapest (its cost columns), when it priced the run; a value of
    another type is refused (logged, naming the file and the field) and left out."""
    url = join(report_url, "preflight.json")
    preflight = read_json(url) if exists(url) else {}
    advisor = preflight.get("advisor") if isinstance(preflight, dict) else None
    cost = advisor.get("cost") if isinstance(advisor, dict) else None
    try:
        return checked(int | None, cost.get("cheapest_workers") if isinstance(cost, dict) else None,
                       f"{url}: advisor.cost.cheapest_workers")
    except DocumentError as error:
        log.warning("%s", error)
        return None


def attach_usage(report_url: str, report: RunReport, released_at: str,
                 dag_id: str | None = None) -> tuple[UsageSummary | None, dict[str, bytes]]:
    """The run's GPU-time ledger with its warnings (logged; release counts and mails those not raised live:
    `unannounced`), and its chart to write beside the report (USAGE_CHART); (None, {}) when the run recorded no
    events. A ledger that cannot be read is logged and left out: it never fails release. With `dag_id`, the
    admission waits of the report's run are read from Airflow."""
    run_url = report_url.rstrip("/").rsplit("/", 1)[0]
    try:
        waits = admission(load_attempts(run_url), dag_id, report.run_id)
        summary = run_usage(run_url, report, released_at, waits)
        if summary is None:
            return None, {}
        summary = replace(summary, cheapest_workers=_cheapest_workers(report_url))
        warnings = cost_warnings(summary, flat_settings(report.config))
        summary = replace(summary, warnings=tuple(warnings))
        for warning in warnings:
            log.warning("%s", warning)
        return summary, {USAGE_CHART: usage_chart(summary)}
    except Exception:  # the ledger is a view of the run; release's proof must not depend on it
        log.exception("could not compute the GPU-time ledger of %s", run_url)
        return None, {}


def unannounced(summary: UsageSummary) -> list[str]:
    """The ledger's warnings not yet counted and mailed: the live idle-held and reclaim ones were, while the groups
    ran."""
    raised_live = {live.warning.text for live in (*summary.idle_warnings, *summary.reclaims)}
    return [warning for warning in summary.warnings if warning not in raised_live]
