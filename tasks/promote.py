"""The promote task: the run's model becomes the next version of its registered model when it is good enough.

Setting `promote`: `auto` promotes when the run's gates passed and its eval loss is not worse than the promoted
version's by more than `promotion_tolerance`; `always` promotes whenever the gates passed; `never` does not. A
promotion copies the model (with its tokenizer), each serving format that passed its parity check (the run's
`export_formats`: a missing or failed one is a failed gate, tasks/exports.py), the report and a model card to
`models/<model_name>/v<N>/`, writes `version.json` last, then moves `latest.json` by compare-and-swap
(tasks/registry.py). The outcome, with the reason and the export gates, goes to `promotion.json` beside the run's
report (its one writer; the run's page shows it as the report's `promotion`, and so does report.md, which the
release task renders after it) and the task log; the DAG turns a promotion into an event of the Asset
`gpt_finetune_model`.

The eval losses compared are the same evaluation sample's whenever possible: the evaluate task scores the promoted
version on this run's sample of the validation split when their tokenizers agree (`report["promoted"]`);
otherwise the version's recorded loss is used, and the reason says whether it was scored on the same sample
(`eval_sample`, trainer/eval_sample.py) or at least the same dataset. `promotion_tolerance` is widened by
GATE_STANDARD_ERRORS standard errors of the delta: paired over the sample's sequences when both were scored here,
else the two recorded errors together (0 when the whole split was scored).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from typing import TYPE_CHECKING, Any

from core.clock import utc_now
from core.config import AccessPolicy, ConfigError, RunConfig
from core.eval_result import GATE_STANDARD_ERRORS
from core.layout import REPORT_JSON, ModelLayout, VersionLayout
from core.storage import (
    exists,
    filesystem,
    join,
    remove_tree,
    write_bytes_atomic,
    write_json_atomic,
)
from tasks import exports, registry
from tasks.base_models import pinned_base
from tasks.checked_run import CheckedRun, OwnRun, checked_run
from tasks.connections import uses_run_storage
from tasks.legacy_models import convert_legacy_model
from tasks.registry import Entry, Pointer, PromotedVersion, VersionFile, VersionRecord
from tasks.report import store as reports
from tasks.report.document import RunFigures, RunReport
from tasks.report.formatting import nats
from tasks.report.parts import RunView, with_exports
from tasks.report.untrusted import read_record
from tasks.results import Promotion
from trainer.decoders.architectures import CheckpointError

if TYPE_CHECKING:
    from tasks.prepared_run import PreparedRun

log = logging.getLogger("gpt_finetune.promote")

VERSION_FORMAT_VERSION = 1
MAX_SWAP_ATTEMPTS = 20


class NoReportError(RuntimeError):
    """The run has no report: evaluate did not get as far as writing one, so there is nothing to promote."""


@dataclasses.dataclass(frozen=True)
class Reference:
    """The promoted version's eval loss a run is compared with (promotion.json's `compared_with`).

    Attributes:
        version: the promoted version (`v<N>`); eval_loss: its loss compared with.
        same_shards, same_sample: whether it was scored on this run's dataset, and on its evaluation sample.
        delta_se: the standard error of the run's loss minus `eval_loss`; None when unknown.
        error_source: how `delta_se` was found, in words; note: where `eval_loss` comes from, in words.
    """

    version: str
    eval_loss: float
    same_shards: bool
    same_sample: bool
    delta_se: float | None
    error_source: str
    note: str


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The promotion rule applied to a report: whether to promote, why, and the reference it was compared with
    (None: nothing promoted yet, or no comparison was needed)."""

    promote: bool
    reason: str
    compared_with: Reference | None = None


@uses_run_storage
def promote_run(prepared: PreparedRun, own: OwnRun) -> Promotion:
    """Promote (or not) the model of DAG run `own`; returns the outcome, which promotion.json records beside the
    report with the export gates it was decided on (report.json stays evaluate's, report.md is release's). Every
    URL is the run's own (tasks/checked_run.py): the report, the model and the exports of its train folder."""
    checked = checked_run(prepared, own)
    cfg = checked.cfg
    report_json = checked.run.report_json
    if not exists(report_json):
        raise NoReportError(
            f"Run {checked.run_id} has no report at {report_json}: evaluate failed before writing it (see its "
            "log), so no model is promoted.")
    report = RunReport.from_json(read_record(report_json), report_json)
    check_model_url(report, checked, report_json)
    exported = exports.export_part(checked.train, cfg)
    outcome = promote(prepared, checked, with_exports(RunView(report), exported),
                      checked.storage.model(cfg.promotion.model_name))
    part = exported.to_json() if exported else {}
    write_json_atomic(checked.run.promotion, {**outcome.to_json(), **part})
    if outcome.promoted:
        log.info("Promoted run %s to %s %s (%s): %s", prepared.run_id, cfg.promotion.model_name, outcome.version,
                 outcome.url, outcome.reason)
    else:
        log.warning("Not promoted: run %s stays out of %s: %s", prepared.run_id, cfg.promotion.model_name,
                    outcome.reason)
    return outcome


def check_model_url(report: RunReport, checked: CheckedRun, report_json: str) -> None:
    """The report's model is the run's own: a report.json rewritten to name another folder is refused (promote
    copies only from the run's train folder, whatever the report names)."""
    named = report.runs.distributed.model_url
    if named != checked.train.model:
        raise exports.ForeignModelError(
            f"{report_json}: runs.distributed.model_url = {named!r} is not this run's model (it must be "
            f"{checked.train.model!r}, the train folder of run key {checked.key!r} under setting 'storage_root'): "
            "the report was rewritten after evaluate wrote it, so nothing is promoted. Run evaluate again.")


def promote(prepared: PreparedRun, checked: CheckedRun, view: RunView, layout: ModelLayout) -> Promotion:
    """Decide against the current pointer, publish a complete version, swap the pointer; on a lost swap decide
    again against the pointer that won. `view`: evaluate's report with promote's export gates."""
    cfg = checked.cfg
    version: VersionLayout | None = None
    number = 0
    for _ in range(MAX_SWAP_ATTEMPTS):
        pointer, token = registry.read_pointer(layout)
        earlier = [entry for entry in (pointer.history if pointer else ()) if entry.run_key == checked.key]
        if earlier:  # a retry after the pointer moved: the run has its version, it gets no second one
            reason = f"already promoted to {earlier[-1].version} by an earlier attempt of this task."
            return outcome(cfg, Verdict(True, reason), promoted=True, entry=earlier[-1])
        verdict = decide(cfg, view, pointer)
        if not verdict.promote:
            if version is not None:  # published, then beaten to the pointer by a better version
                remove_tree(version.url)
            return outcome(cfg, verdict, promoted=False)
        current = pointer.number if pointer else 0
        if version is None or number <= current:  # the pointer only moves to higher numbers
            if version is not None:
                remove_tree(version.url)
            number = registry.claim_version(layout, current, checked.run_id)
            version = layout.version(number)
            publish_version(version, prepared, checked, view, number, verdict)
        entry = history_entry(version, checked, view.report, number)
        if registry.swap_pointer(layout.latest, token, Pointer.moved_to(entry, cfg.promotion.model_name, pointer)):
            return outcome(cfg, verdict, promoted=True, entry=entry)
        log.info("Another promotion moved %s first; deciding again against it.", layout.latest)
    raise registry.RegistryError(
        f"{layout.latest} kept changing under {MAX_SWAP_ATTEMPTS} promotion attempts of run {checked.run_id}: "
        "other runs are promoting continuously; trigger this run's promote task again.")


def decide(cfg: RunConfig, view: RunView, pointer: Pointer | None) -> Verdict:
    """The rule of setting `promote` applied to this report."""
    if cfg.promotion.promote == "never":
        return Verdict(False, "setting 'promote' = 'never'.")
    report = view.report  # with promote's export gates
    if not report.gates_passed:
        failed = "; ".join(gate.detail for gate in report.failed_gates())
        return Verdict(False, f"the run's gates failed ({failed}), so it is never promoted.")
    loss = report.runs.distributed.eval_loss
    if pointer is None:
        return Verdict(True, f"first version of '{cfg.promotion.model_name}' (eval loss {loss:.4f}).")
    reference = reference_loss(report, pointer)
    delta = loss - reference.eval_loss
    limit = cfg.promotion.promotion_tolerance + GATE_STANDARD_ERRORS * (reference.delta_se or 0.0)
    comparison = (f"eval loss {loss:.4f} vs {reference.eval_loss:.4f} of promoted {pointer.version} "
                  f"(run {pointer.run_id}): {nats(delta)} nats, {_allowance(cfg, reference, limit)}; "
                  f"{reference.note}")
    if cfg.promotion.promote == "always":
        return Verdict(True, f"setting 'promote' = 'always' ({comparison}).", reference)
    if math.isfinite(delta) and delta <= limit:
        return Verdict(True, f"not worse than the promoted version: {comparison}.", reference)
    return Verdict(False, f"worse than the promoted version by more than 'promotion_tolerance': {comparison}. "
                           "Raise 'promotion_tolerance' or set 'promote' = 'always' to promote it anyway.", reference)


def _allowance(cfg: RunConfig, reference: Reference, limit: float) -> str:
    if not reference.delta_se:
        return f"tolerance {cfg.promotion.promotion_tolerance:.4f} (no sampling error)"
    return (f"limit {limit:.4f} = tolerance {cfg.promotion.promotion_tolerance:.4f} + {GATE_STANDARD_ERRORS:g} x "
            f"{reference.delta_se:.4f}, the standard error of the delta ({reference.error_source})")


def reference_loss(report: RunReport, pointer: Entry) -> Reference:
    """The promoted version's eval loss to compare with, where it comes from, and the standard error of the run's
    loss minus it (`delta_se`: None when unknown)."""
    scored = report.promoted
    fingerprint = report.dataset_fingerprint
    sample = _sample_id(report)
    if scored and scored.version == pointer.version and scored.eval_loss is not None:
        return Reference(pointer.version, scored.eval_loss, same_shards=True, same_sample=True,
                         delta_se=scored.delta_se, error_source="paired over the sample's sequences",
                         note=f"both scored on this run's evaluation sample {sample} (dataset {fingerprint})")
    same = pointer.dataset_fingerprint == fingerprint
    same_sample = sample is not None and pointer.eval_sample == sample
    if same_sample:
        where = f"on the same evaluation sample {sample} (dataset {fingerprint})"
    elif same:
        where = (f"on the same dataset {fingerprint} but NOT the same evaluation sample ({pointer.eval_sample}"
                 f", this run {sample})")
    else:
        where = (f"NOT on the same validation shards: it was scored on dataset {pointer.dataset_fingerprint}, "
                 f"this run on {fingerprint}")
    note = f"its recorded eval loss, {where}" + (f" ({scored.note})" if scored and scored.note else "")
    errors = [report.runs.distributed.eval_loss_se, pointer.eval_loss_se]
    delta_se = math.hypot(*errors) if all(isinstance(error, (int, float)) for error in errors) else None
    return Reference(pointer.version, pointer.eval_loss, same_shards=same, same_sample=same_sample,
                     delta_se=delta_se, error_source="both recorded errors together", note=note)


def _sample_id(report: RunReport) -> str | None:
    return report.eval_sample.id if report.eval_sample else None


def outcome(cfg: RunConfig, verdict: Verdict, *, promoted: bool, entry: Entry | None = None) -> Promotion:
    """What the report, the task log and (as `event`, the Asset event's extra) downstream DAGs learn."""
    event = {"model_name": cfg.promotion.model_name, **{name: getattr(entry, name) for name in (
        "version", "url", "model_url", "run_id", "eval_loss", "perplexity", "dataset_fingerprint")}} if entry else None
    return Promotion(promoted=promoted, policy=cfg.promotion.promote, model_name=cfg.promotion.model_name,
                     reason=verdict.reason,
                     compared_with=dataclasses.asdict(verdict.compared_with) if verdict.compared_with else None,
                     version=entry.version if entry else None, url=entry.url if entry else None,
                     model_url=entry.model_url if entry else None, event=event, decided_at=utc_now())


def history_entry(version: VersionLayout, checked: CheckedRun, report: RunReport, number: int) -> Entry:
    """The pointer's entry of the version this run became."""
    distributed = report.runs.distributed
    return Entry(version=f"v{number}", number=number, url=version.url, model_url=version.model,
                 run_id=checked.run_id, run_key=checked.key, promoted_at=utc_now(),
                 eval_loss=distributed.eval_loss, perplexity=distributed.perplexity,
                 eval_loss_se=distributed.eval_loss_se, eval_sample=_sample_id(report),
                 dataset_fingerprint=report.dataset_fingerprint,
                 run_report_url=checked.run.report_json)


# ---------------------------------------------------------------------------------------------------------------
# a version's files


def publish_version(version: VersionLayout, prepared: PreparedRun, checked: CheckedRun, view: RunView,
                    number: int, verdict: Verdict) -> None:
    """The model and exports of the run's own train folder, the report (with the export gates and record) and model
    card, then version.json listing them: complete, or never pointed to."""
    cfg, report = checked.cfg, view.report
    distributed = report.runs.distributed
    files = registry.copy_into(version, "model", checked.train.model)
    lora = registry.adapter_base(checked.train.adapter) if cfg.adapter == "lora" else None
    if lora is not None:  # the adapter in PEFT's layout beside the merged model
        files += registry.copy_into(version, "adapter", checked.train.adapter)
    files += exports.copy_exports(view.exported, checked.train, version)
    write_json_atomic(version.report, view.to_json())
    write_bytes_atomic(version.model_card, model_card(cfg, prepared, view, number, verdict).encode("utf-8"))
    files += [VersionFile("report.json", _size(version.report)),
              VersionFile("model_card.md", _size(version.model_card))]
    write_json_atomic(version.record, VersionRecord(
        format_version=VERSION_FORMAT_VERSION, name=cfg.promotion.model_name, version=f"v{number}",
        run_id=checked.run_id, run_key=checked.key, created_at=utc_now(),
        eval_loss=distributed.eval_loss, perplexity=distributed.perplexity,
        eval_loss_se=distributed.eval_loss_se, eval_sample=_sample_id(report),
        dataset_fingerprint=report.dataset_fingerprint, base_model=pinned_base(cfg), adapter_base=lora,
        files=tuple(files),
    ).to_xcom())


def _evaluated(distributed: RunFigures) -> str:
    sample = distributed.eval_sample
    if sample is None:
        return f"{distributed.eval_tokens} tokens"
    error = distributed.eval_loss_se
    return (f"{sample.tokens} of {sample.split_tokens} validation tokens, sample {sample.id}"
            + (f"; standard error {error:.4f}" if error else ""))


def _size(url: str) -> int:
    fs, path = filesystem(url)
    return fs.size(path)


def _code(value: Any) -> str:
    """`value` as one inline code span that nothing in it can end: control and non-ASCII characters escaped as JSON
    writes them, a fence longer than any run of backticks inside (CommonMark renders a code span's `<` as text)."""
    text = json.dumps(str(value))[1:-1]
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _settings_json(cfg: RunConfig) -> str:
    """The settings as a fenced block's JSON: every string quoted and escaped, no line that could close the fence."""
    return json.dumps(cfg.settings(), indent=2, ensure_ascii=True, default=list)


def model_card(cfg: RunConfig, prepared: PreparedRun, view: RunView, number: int, verdict: Verdict) -> str:
    report = view.report
    distributed = report.runs.distributed
    continued = report.continued_from
    pinned = pinned_base(cfg)
    base = (f"continued from {continued.name} {continued.version} ({_code(continued.url)})" if continued else
            f"{_code(pinned.name)} at commit {_code(pinned.sha)} (revision {_code(pinned.revision)}, fetched once to "
            f"{_code(pinned.url)})" if pinned else _code(cfg.model))
    lines = [
        f"# {cfg.promotion.model_name} v{number}",
        "",
        f"Promoted {utc_now()} from run {_code(prepared.run_id)} (policy `{cfg.promotion.promote}`): {verdict.reason}",
        "",
        f"- Base model: {base}",
        (f"- Data: dataset fingerprint {_code(report.dataset_fingerprint)} (setting `dataset` = {_code(cfg.dataset)}, "
        f"tokenizer {_code(cfg.tokenizer)}, validation fraction {cfg.val_fraction})"),
        (f"- Training: {distributed.num_workers} workers, {distributed.steps} steps of "
        f"{distributed.global_batch_size} sequences x {cfg.block_size} tokens"),
        (f"- Eval loss on the validation split: {distributed.eval_loss:.4f} nats, perplexity "
        f"{distributed.perplexity:.2f} ({_evaluated(distributed)})"),
        (f"- Run report: {join(prepared.report_url, REPORT_JSON)} (the run's release task writes "
         f"{reports.REPORT_MD} beside it)"),
        "",
        "## Gates",
        "",
    ]
    lines += [f"- {gate.name}: {'pass' if gate.passed else 'FAIL'} ({gate.detail})" for gate in report.gates]
    lines += ["", *exports.card_lines(cfg, view.exported), "## Settings", "", "```json", _settings_json(cfg), "```"]
    lines += ["", "## Versions", ""]
    lines += [f"- {name}: {value}" for name, value in sorted((report.versions or {}).items())]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# continuing from a promoted version (the prepare task)


def resolve_promoted_model(cfg: RunConfig) -> tuple[RunConfig, PromotedVersion | None]:
    """For `model: promoted[:<name>]`, the config that trains from the latest version's files, and that version.

    The tokenizer of a `bpe:<n>` run becomes the version's own: a continued model needs the token ids it was
    trained with, which a BPE trained afresh on changed data would not give. Raises ConfigError, naming the
    setting and the path, when nothing is promoted under that name."""
    name = cfg.promoted_source
    if name is None:
        return cfg, None
    layout = registry.model_layout(cfg.storage_root, name)
    try:
        pointer = registry.read_latest(layout)
    except registry.RegistryError as error:  # e.g. a pointer that names a model outside its version's folder
        raise ConfigError(f"Setting 'model' = {cfg.model!r}: {error}") from error
    if pointer is None:
        raise ConfigError(
            f"Setting 'model' = {cfg.model!r}: no promoted version of '{name}' exists ({layout.latest} is missing). "
            "Run once with a preset or another model and promote it first, or set 'model_name' / 'model' to a "
            "model that has one.")
    if registry.complete_version(layout.version(pointer.number)) is None:
        raise ConfigError(
            f"Setting 'model' = {cfg.model!r}: {name} {pointer.version} at {pointer.url} is incomplete (a file "
            "its version.json lists is missing or has another size): restore it, or promote another run.")
    setting = f"Setting 'model' = {cfg.model!r} ({name} {pointer.version})"
    try:
        if convert_legacy_model(pointer.model_url, setting):
            log.info("%s %s held tf_model.h5 only: converted once to model.safetensors", name, pointer.version)
    except CheckpointError as error:
        raise ConfigError(str(error)) from None
    changes = {"model": pointer.model_url}
    if cfg.bpe_vocab_size is not None:
        changes["tokenizer"] = pointer.model_url
        log.info("Setting 'tokenizer' = %r replaced by the tokenizer of %s %s: continuing needs its token ids.",
                 cfg.tokenizer, name, pointer.version)
    log.info("Continuing from %s %s (run %s, eval loss %.4f): %s", name, pointer.version, pointer.run_id,
             pointer.eval_loss, pointer.model_url)
    resolved = cfg.replace(**changes)
    # The registry's URL may name only what a setting may (`from_params` checked the settings themselves).
    AccessPolicy.from_env().check_settings(resolved)
    return resolved, PromotedVersion.of(name, pointer)


