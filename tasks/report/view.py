"""What a run's report says, built once from report.json and written twice: as report.md (tasks/report/markdown.py) and
as the UI's run page (the UI plugin's report_pages.py).

The view is plain text in a few shapes (tasks/report/blocks.py: sections of paragraphs, bullet lists, tables,
warnings, charts, with three marks inside a line: emphasis, code and a verdict). Each writer decides how they look
and escapes what its format needs, so a section is added or changed here, once, for both.

report.json comes from storage that many tasks can write: the view is built from the report as read and checked
(tasks/report/document.py's `RunReport`, in tasks/report/parts.py's `RunView` with promote's and release's parts),
so its fields are of their types; a missing figure reads as "—". The parts other tasks own that it shows as they are
(the promotion verdict, the GPU-time ledger) are read tolerantly: a missing field or a wrong type reads as "—" or as
its text, never as an error.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tasks.report.blocks import (
    Block,
    Bullets,
    Charts,
    Code,
    Emphasis,
    Line,
    Mark,
    Paragraph,
    ReportView,
    Section,
    Table,
    Verdict,
    Warnings,
)
from tasks.report.document import BaselineOrigin, Comparison, RunFigures, RunReport, table_rows
from tasks.report.formatting import KNOWN_WORDS_NOTE, TABLE_COLUMNS, fmt, known_words, nats
from tasks.report.parts import RunView

if TYPE_CHECKING:
    from core.summary import MemoryFigures


def report_view(view: RunView) -> ReportView:
    """The report's sections in order (`view`: the report as tasks/report/parts.py merges its three files)."""
    report = view.report
    sections = (opening(view), gates(report), *scaling(report), *gpu_time(view), promotion(view), *samples(report),
                charts(report), versions(report))
    return ReportView(("GPT fine-tune run ", Code(report.run_id)), sections)


def text(value: Any) -> str:
    return "—" if value is None else str(value)


def opening(view: RunView) -> Section:
    """The verdicts and the run's shape, throughput warnings, the figures and what to read them with."""
    report, released = view.report, view.released
    distributed = report.runs.distributed
    shape = (f" · {report.num_workers} workers · model {text(report.config.get('model'))} · "
             f"global batch {distributed.global_batch_size} · {distributed.steps} steps · created {report.created_at}")
    headline = _paragraph(Verdict("PASSED" if report.gates_passed else "FAILED", report.gates_passed, "Gates"), " · ",
                          Verdict(released, {"yes": True, "no": False}.get(released), "Released", anchor="released"),
                          shape, *elastic_headline(report))
    comparison = report.comparison
    notes = Bullets((
        _paragraph(f"Speedup T1/TN: {fmt(comparison.speedup, '.2f', 'x')}; scaling efficiency "
                   f"(speedup / N): {fmt(comparison.efficiency, '.0f', '%', scale=100)}"),
        *gradient_all_reduce(report),
        _paragraph(f"Eval loss delta (distributed - baseline): {nats(comparison.loss_delta)} nats "
                   f"{_delta_error(comparison)}(tolerance ±{fmt(comparison.loss_tolerance, '.4f')})"),
        *evaluation_sample(report),
        _paragraph(KNOWN_WORDS_NOTE),
        _paragraph(f"Hardware: {text(report.hardware.line if report.hardware else None)}", anchor="hardware"),
        *gpu_memory(report),
        *memory_forecast(report),
        *release_after_train(report),
        _paragraph("Baseline: ", *baseline_line(report.baseline)),
    ))
    figures = Table(TABLE_COLUMNS, tuple(tuple(row[column] for column in TABLE_COLUMNS) for row in table_rows(report)),
                    anchor="figures")
    return Section(None, (headline, *([Warnings(report.warnings)] if report.warnings else []), figures, notes))


def _runs(report: RunReport) -> list[tuple[str, RunFigures]]:
    """The trained models by name, the distributed one first."""
    runs = (("distributed", report.runs.distributed), ("baseline", report.runs.baseline))
    return [(name, run) for name, run in runs if run is not None]


def gpu_memory(report: RunReport) -> tuple[Paragraph, ...]:
    """The chief's GPU memory per trained model, when a run had a GPU: the peak TensorFlow used (what training needs)
    beside the memory in use on the device (what TensorFlow reserved at start-up)."""
    shown = [(name, run) for name, run in _runs(report)
             if run.gpu_mem_peak_mb is not None or run.gpu_mem_reserved_mb is not None]
    if not shown:
        return ()
    figures = "; ".join(f"{name} peak {fmt(run.gpu_mem_peak_mb, ',.0f', ' MiB')} used by TensorFlow, "
                        f"{fmt(run.gpu_mem_reserved_mb, ',.0f', ' MiB')} in use on the GPU"
                        for name, run in shown)
    return (_paragraph(f"GPU memory of rank 0: {figures} (TensorFlow reserves nearly all of the GPU at start-up; "
                       "the peak is what training needed)"),)


def memory_forecast(report: RunReport) -> tuple[Paragraph, ...]:
    """Rank 0's memory forecast per trained model (what preflight checked against the GPU) beside its measured
    peak, so a forecast that drifts from what training takes shows in the report."""
    shown = [(name, run.memory) for name, run in _runs(report) if run.memory is not None]
    if not shown:
        return ()
    figures = "; ".join(f"{name} forecast {fmt(memory.forecast_mb.get('total'), ',.0f', ' MiB')} "
                        f"(activations {fmt(memory.forecast_mb.get('activations'), ',.0f', ' MiB')}), "
                        f"{_measured_peak(memory)}" for name, memory in shown)
    return (_paragraph(f"Memory per worker, rank 0: {figures}"),)


def _measured_peak(memory: MemoryFigures) -> str:
    if memory.gpu_mem_peak_mb is not None:
        return f"TensorFlow's peak on the GPU {fmt(memory.gpu_mem_peak_mb, ',.0f', ' MiB')}"
    return f"peak resident memory {fmt(memory.peak_rss_mb, ',.0f', ' MiB')}, TensorFlow itself included"


def release_after_train(report: RunReport) -> tuple[Paragraph, ...]:
    """How soon after each training group exited its slots were proven free (tasks/launch.py), when known."""
    shown = [(name, run.release_after_train_s) for name, run in _runs(report) if run.release_after_train_s is not None]
    if not shown:
        return ()
    figures = "; ".join(f"{name} {fmt(value, '.2f', ' s')}" for name, value in shown)
    return (_paragraph(f"Released after training: the workers' slots were proven free {figures} after they exited, "
                       "before the run's release", anchor="release-after-train"),)


def gradient_all_reduce(report: RunReport) -> tuple[Paragraph, ...]:
    """How the distributed run's gradients crossed the network (its summary's `allreduce`), when it says."""
    allreduce = report.runs.distributed.allreduce
    if not allreduce:
        return ()
    over = (f" over {text(allreduce['implementation']).upper()} ('communication' = "
            f"'{text(report.config.get('communication'))}')" if allreduce.get("implementation") else "")
    packs = allreduce.get("packs")
    if packs is None:
        sent = "one worker: nothing crossed the network"
    else:
        sent = f"{text(packs)} pack(s) of >= {fmt(allreduce.get('pack_mb'), 'g')} MiB" + (
            ", overlapping the backward pass" if allreduce.get("overlap") is True else "")
    return (_paragraph(f"Gradient all-reduce: {text(allreduce.get('dtype'))}{over}, {sent}"),)


def _delta_error(comparison: Comparison) -> str:
    error = comparison.loss_delta_se
    return f"± {fmt(error, '.4f')} " if error else ""


def evaluation_sample(report: RunReport) -> tuple[Paragraph, ...]:
    """What the models were scored on: tokens evaluated out of the split's, the sample, and the error's meaning."""
    sample = report.eval_sample
    if sample is None:
        return ()
    workers = f"scored on {text(sample.workers)} worker(s)"
    if sample.whole_split:
        asked = sample.asked_tokens
        why = ("'eval_tokens' = 0" if asked == 0 else
               f"'eval_tokens' = {fmt(asked, ',.0f')} asks for more than the split holds, so all of it is used")
        return (_paragraph(f"Evaluation: the whole validation split, {fmt(sample.split_tokens, ',.0f')} "
                           f"tokens ({why}), {workers}; the losses have no sampling error.", anchor="eval-sample"),)
    tokens, total = sample.tokens, sample.split_tokens
    share = fmt(tokens / total, ".1%") if tokens is not None and total else "—"
    return (_paragraph(f"Evaluation: {fmt(tokens, ',.0f')} of {fmt(total, ',.0f')} validation tokens ({share}; "
                       f"{fmt(sample.sequences, ',.0f')} sequences), sample ", Code(text(sample.id)),
                       f" (the same for every model of this run and every run on this dataset), {workers}; each "
                       "eval loss is given ± its standard error over the sampled sequences.", anchor="eval-sample"),)


def elastic_headline(report: RunReport) -> Line:
    """` · elastic: ...` for the headline, nothing for a run on its asked workers throughout."""
    if not report.elastic:
        return ()
    changes = [segment.line for index, segment in enumerate(report.segments)
               if index or segment.num_workers != report.num_workers]
    return (" · ", Emphasis("elastic"), ": " + "; ".join(changes))


def baseline_line(baseline: BaselineOrigin | None) -> Line:
    policy = baseline.policy if baseline else None
    if policy == "skip":
        return ("skipped (policy 'skip'): no speedup or loss parity",)
    origin = "reused from run" if baseline and baseline.reused else "trained by this run"
    return (Code(text(baseline.key if baseline else None)),
            f", {origin} {(baseline.trained_by_run if baseline else None) or '(unknown)'} (policy '{text(policy)}')")


def gates(report: RunReport) -> Section:
    rows = tuple((gate.name, Verdict("pass", True) if gate.passed else Verdict("FAIL", False),
                  fmt(gate.value, ".4g"), fmt(gate.limit, ".4g"), gate.detail) for gate in report.gates)
    return Section("Gates", (Table(("gate", "result", "value", "limit", "detail"), rows, anchor="gates",
                                   prose=("detail",)),))


def scaling(report: RunReport) -> list[Section]:
    """An elastic run's segments (tasks/report/scaling.py), and the advisor's predicted scaling next to the measured."""
    sections = []
    if report.elastic and report.segments:
        rows = tuple((f"{segment.from_step + 1}-{segment.to_step}", f"{segment.num_workers} of {report.num_workers}",
                      str(segment.grad_accum_steps), fmt(segment.tokens_per_s, ",.0f"), segment.line)
                     for segment in report.segments)
        sections.append(Section("Segments (elastic recovery)", (Table(
            ("steps", "workers", "accumulation", "tokens/s (step time)", "what happened"), rows, anchor="segments",
            prose=("what happened",)),)))
    predicted = report.prediction
    if predicted is not None:
        row = (str(predicted.num_workers), fmt(predicted.predicted_speedup, ".2f", "x"),
               fmt(predicted.measured_speedup, ".2f", "x"),
               fmt(predicted.predicted_efficiency, ".0f", "%", scale=100),
               fmt(predicted.measured_efficiency, ".0f", "%", scale=100))
        advice = (f"Advisor (single-worker step from the {text(predicted.step_source)}): "
                  f"{text(predicted.recommendation)}")
        sections.append(Section("Scaling: predicted (preflight advisor) vs measured", (
            Table(("workers", "predicted speedup", "measured speedup", "predicted efficiency", "measured efficiency"),
                  (row,), anchor="prediction"), _bullets([advice]))))
    return sections


def promotion(view: RunView) -> Section:
    """The promote task's verdict and why, or where the run continued from."""
    items = []
    continued = view.report.continued_from
    if continued is not None:
        items.append(_paragraph(f"Continued from {text(continued.name)} {text(continued.version)} "
                                f"(run {text(continued.run_id)}, eval loss {fmt(continued.eval_loss, '.4f')})"))
    decision = view.promotion
    if decision is None:
        items.append(_paragraph("Pending: the promote task has not run yet."))
    elif "unreadable" in decision:  # tasks/report/parts.py: promotion.json exists but cannot be read
        items.append(_paragraph(Verdict("Unknown", False), f": the promote task's record cannot be read "
                                f"({text(decision.get('unreadable'))})."))
    elif decision.get("promoted") is True:
        items.append(_paragraph(Verdict("Promoted", True), f" to {text(decision.get('model_name'))} "
                                f"{text(decision.get('version'))} ({text(decision.get('url'))}): "
                                f"{text(decision.get('reason'))}"))
    else:
        items.append(_paragraph(Verdict("Not promoted", False), f" (policy '{text(decision.get('policy'))}'): "
                                f"{text(decision.get('reason'))}"))
    return Section("Promotion", (Bullets(tuple(items)),))


MAX_PROMPTS_SHOWN = 50  # a report from storage may hold any number: the page stays small and linear


def samples(report: RunReport) -> list[Section]:
    """Each model's sample scores, then each prompt (the first MAX_PROMPTS_SHOWN) with every model's greedy and
    top-k continuation; each model's samples are read once, so the work is linear in them."""
    models = report.samples[:MAX_PROMPTS_SHOWN]
    if not models:
        return []
    names = ", ".join(model.model for model in models)
    blocks: list[Block] = [
        _paragraph(f"Greedy and top-k continuations of the same prompts from the validation text (fixed seed): "
                   f"{names}."),
        Table(("model", "eval loss", "nats/char", "known words (greedy / top-k)"),
              tuple((model.model, fmt(model.eval_loss, ".4f"), fmt(model.nats_per_char, ".3f"),
                     known_words(model.known_words)) for model in models), anchor="sample-quality")]
    per_model = [(model.model, model.samples[:MAX_PROMPTS_SHOWN]) for model in models]
    for index, first in enumerate(per_model[0][1]):
        rows = tuple((name, _generated(own[index].greedy), _generated(own[index].top_k))
                     for name, own in per_model if index < len(own))
        blocks += [_paragraph(Emphasis(f"Prompt {index + 1}:"), " ", _generated(first.prompt)),
                   Table(("model", "greedy", "top-k"), rows, prose=("greedy", "top-k"))]
    return [Section("Samples", tuple(blocks))]


def charts(report: RunReport) -> Section:
    files = tuple((name, file) for name, file in report.charts.items() if name != "usage")  # in "GPU time and cost"
    return Section("Charts", (Charts(files),))


def usage_line(usage: Any) -> str:
    """One sentence: "2 workers held 0.08 worker-h (0.08 EUR at 1 EUR/worker-h, on_demand): 31% training, 69% idle:
    between tasks 30%, start-up 20%, ...; free 0.4 s after the last worker exited"."""
    unit = "GPU" if _get(usage, "unit") == "gpu_hour" else "worker"
    held = _get(usage, "held_gpu_h")
    price, cost = _get(usage, "price"), _get(usage, "cost")
    priced = (f" ({fmt(_get(cost, 'held'), '.4g')} {text(_get(price, 'currency'))} at {text(_get(price, 'rate'))} "
              f"{text(_get(price, 'currency'))}/{unit}-h, {text(_get(price, 'capacity'))})" if cost else
              " (no price: cost not shown)")
    causes = sorted(((c, h) for c, h in _dict(usage if isinstance(usage, dict) else {}, "idle_by_cause_gpu_h").items()
                     if isinstance(h, int | float) and h > 0), key=lambda item: -item[1])
    share = _get(usage, "busy_share")
    split = ", ".join(f"{c.replace('_', ' ')} {fmt(h / held, '.0f', '%', scale=100)}" for c, h in causes
                      if isinstance(held, int | float) and held > 0)
    return (f"{text(_get(usage, 'slots'))} {unit} slots held {fmt(held, '.3g')} {unit}-h{priced}: "
            f"{fmt(share, '.0f', '%', scale=100)} training"
            + (f", {fmt(1 - share, '.0f', '%', scale=100)} idle: {split}" if isinstance(share, int | float) else "")
            + f"; free {fmt(_get(usage, 'time_to_release_s'), '.1f')} s after the last worker exited")


def waited_line(usage: Any) -> str:
    """How long the GPU tasks waited for admission in Airflow (not charged), or why that is not known."""
    waited = _get(usage, "waited_s")
    if not isinstance(waited, int | float):
        return f"Waited for admission in Airflow: unknown ({text(_get(usage, 'waited_note'))}); nothing charged for it."
    carved = _get(usage, "waited_gpu_h")
    return (f"Waited for admission in Airflow (scheduled to queued, every try of the GPU tasks): {waited:.1f} s, not "
            "charged" + (f"; {fmt(carved, '.4g')} slot-h of it fell between the run's groups and are left out of held"
                         if isinstance(carved, int | float) and carved > 0 else "") + ".")


def gpu_time(view: RunView) -> list[Section]:
    """Held, busy and idle time by cause, per slot and attempt, the price and the cost (release.json's `usage`)."""
    usage = view.usage
    if usage is None:
        return []
    unit = "GPU" if usage.get("unit") == "gpu_hour" else "worker"
    held = usage.get("held_gpu_h") if isinstance(usage.get("held_gpu_h"), int | float) else None
    causes = Table(("cause", f"{unit}-h", "share of held"), tuple(
        (cause.replace("_", " "), fmt(hours, ".4f"), fmt(hours / held if held else None, ".1f", "%", scale=100))
        for cause, hours in [("training (busy)", usage.get("busy_gpu_h")),
                             *_dict(usage, "idle_by_cause_gpu_h").items()]
        if isinstance(hours, int | float) and (hours > 0 or cause.startswith("training"))), anchor="usage-causes")
    slots = Table(("slot", "held h", "busy h", "idle h"), tuple(
        (text(row.get("slot")), fmt(row.get("held_h"), ".4f"), fmt(row.get("busy_h"), ".4f"),
         fmt(row.get("idle_h"), ".4f")) for row in _items(usage.get("per_slot"))))
    attempts = Table(("group", "attempt", "try", "state", "workers"), tuple(
        tuple(text(row.get(name)) for name in ("group", "attempt", "try_number", "state", "workers"))
        for row in _items(usage.get("attempts"))))
    notes = [f"Price: {text(_get(usage, 'price', 'source'))}" + (f"; {_get(usage, 'price', 'note')}" if
                                                                  _get(usage, "price", "note") else "")
             if usage.get("price") else "No price table (GPT_FINETUNE_PRICING): GPU-hours only, cost not shown."]
    efficiency, cost = usage.get("efficiency"), _dict(usage, "cost")
    if isinstance(efficiency, int | float) and efficiency > 0:
        notes.append(f"At {efficiency:.0%} scaling efficiency the {text(usage.get('workers'))} workers used "
                     f"{1 / efficiency:.2f}x the {unit}-hours per token of one worker"
                     + (f"; extra cost of parallelism {fmt(cost.get('extra_for_parallelism'), '.4g')}"
                        if cost else "") + ".")
    if cost.get("per_mtoken") is not None:
        notes.append(f"Cost per million tokens trained: {fmt(cost.get('per_mtoken'), '.4g')} "
                     f"{text(_get(usage, 'price', 'currency'))}.")
    if "waited_s" in usage:
        notes.append(waited_line(usage))
    if isinstance(usage.get("idle_warnings"), list):
        idle = _items(usage.get("idle_warnings"))
        notes.append(f"Idle-held warnings (checked live while groups ran, max_idle_held_s): {len(idle)}"
                     + "".join(f"; {text(row.get('at'))}: {text(row.get('group'))} slots "
                               f"{', '.join(map(text, row.get('slots') or []))} idle {fmt(row.get('idle_s'), '.0f')} s"
                               for row in idle) + ".")
    reclaims = _items(usage.get("reclaims")) if isinstance(usage.get("reclaims"), list) else []
    if reclaims:
        notes.append(f"Reclaimed (held idle past reclaim_idle_after_s, stopped, the task failed without a retry): "
                     f"{len(reclaims)}, {fmt(usage.get('reclaimed_gpu_h'), '.4g')} {unit}-h held idle by then"
                     + "".join(f"; {text(row.get('at'))}: {text(row.get('group'))} (attempt {text(row.get('attempt'))})"
                               f" slots {', '.join(map(text, row.get('slots') or []))} idle "
                               f"{fmt(row.get('idle_s'), '.0f')} s" for row in reclaims) + ".")
    if usage.get("clock_skew_s"):
        notes.append(f"Release's clock was {fmt(usage.get('clock_skew_s'), '.1f')} s behind a worker's exit: the "
                     "held time ends at the last exit.")
    chart = view.report.charts.get("usage")
    return [Section("GPU time and cost", (
        _paragraph(usage_line(usage), anchor="usage"), causes, slots, attempts, _bullets(notes),
        *([Charts((("usage", chart),))] if isinstance(chart, str) else [])))]


def versions(report: RunReport) -> Section:
    return Section("Versions", (_bullets(f"{name}: {text(value)}" for name, value in sorted(
        (report.versions or {}).items())),))


def _generated(value: str) -> str:
    """Generated text as it is; a sample of nothing but whitespace says so."""
    return value if value.strip() else "(empty)"


def _paragraph(*line: Mark, anchor: str | None = None) -> Paragraph:
    return Paragraph(line, anchor)


def _bullets(lines: Iterable[str]) -> Bullets:
    return Bullets(tuple(_paragraph(line) for line in lines))


def _get(value: Any, *path: str) -> Any:
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _dict(report: dict[str, Any], name: str) -> dict[Any, Any]:
    value = report.get(name)
    return value if isinstance(value, dict) else {}


def _items(value: Any) -> list[dict[str, Any]]:
    """The dicts of a list from the report; anything else reads as none."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []
