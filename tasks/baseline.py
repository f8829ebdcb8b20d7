"""The single-worker baseline: what identifies it, and whether this run has to train it.

A baseline is one worker with the run's global batch (gradient accumulation x N) and the same optimizer steps.
Its result depends on the data, the model, the hyperparameters, the trainer code and the numerics, not on how
many workers the distributed run used; its cached evaluation (`eval.json`) also on the evaluation sample, whose
identity is part of the key (trainer/eval_sample.py), so a reused baseline was scored on this run's sample. Runs
with different `num_workers` but the same global batch share one baseline under `<root>/baselines/<baseline_key>/`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.clock import utc_now
from core.config import RunConfig
from core.document import Document, DocumentError, OpenDocument
from core.layout import safe_name
from core.storage import exists, join, list_dir, read_json, remove_tree, write_json_atomic
from core.summary import TrainSummary
from launcher.host_probe import package_versions
from tasks.checked_run import OwnRun, checked_run
from tasks.connections import uses_run_storage
from trainer.eval_sample import sample_identity
from trainer.host_info import code_fingerprint

if TYPE_CHECKING:
    from tasks.prepared_run import PreparedRun

log = logging.getLogger("gpt_finetune.baseline")

KEY_FORMAT_VERSION = 2  # 2: the evaluation sample's identity
KEY_RECORD = "baseline_key.json"  # the key's parts, next to the baseline's output, to explain later mismatches
# Libraries whose version can change the numbers a baseline produces (read from metadata: no TF import here).
NUMERIC_LIBRARIES = ("tensorflow", "transformers")
# The code every worker runs that decides what it computes: the trainer and the core it stands on (the config).
WORKER_SOURCES = {folder: Path(__file__).resolve().parents[1] / folder for folder in ("core", "trainer")}

# Settings that cannot change what the baseline learns. Everything else is part of the key, so a setting added
# later counts by default. The dataset settings are left out because the dataset fingerprint stands for them;
# `max_steps`/`epochs` because the resolved step count does; `eval_tokens` because the sample's identity does.
_NOT_IN_KEY = frozenset({
    "num_workers", "backend", "ssh_conn_ids", "workers_per_host", "remote_python", "remote_workdir", "baseline",
    "loss_tolerance", "storage_root", "storage_conn_id",
    "checkpoint_every_steps", "communication", "collective_timeout_s", "startup_timeout_s", "hang_timeout_s",
    "dataset", "text_column", "tokenizer", "val_fraction", "num_shards", "max_steps", "epochs", "eval_tokens",
    "min_workers", "min_predicted_efficiency",
    "allreduce_pack_mb",  # one worker all-reduces nothing (its wire dtype counts: it makes the same round trip)
    "model_name", "promotion_tolerance", "promote",  # what happens to the model after training
    "max_loss_rise", "min_throughput_ratio", "alert_conn_id", "alert_emails",  # watching the run, not its numbers
    "capacity", "max_idle_held_s", "idle_gpu_util_pct", "min_cost_efficiency", "max_release_s",  # what it costs
    "max_run_cost",
})


@dataclass(frozen=True)
class KeyParts(Document):
    """Everything that changes a baseline's result: what its key hashes (`to_json()`, flat) and its key record keeps.

    Attributes:
        key_format_version: `KEY_FORMAT_VERSION` when it was planned.
        dataset_fingerprint, tokenizer_fingerprint: the data's; eval_sample: the evaluation sample's id (None in
            key format 1, before it).
        global_batch_size, steps: the baseline's batch and optimizer steps.
        code_version: the trainer sources' fingerprint; libraries: the numeric libraries' versions (None: not
            installed).
        settings: every other setting in the key by its flat name, as `RunConfig.settings()` gives it (checked by
            the config's schema when it was set; here only compared, never acted on).
    """

    key_format_version: int
    dataset_fingerprint: str
    tokenizer_fingerprint: str
    global_batch_size: int
    steps: int
    code_version: str
    libraries: dict[str, str | None]
    settings: dict[str, Any]
    eval_sample: str | None = None

    REST = "settings"  # read back: the fields checked, every other key a setting

    def to_xcom(self) -> dict[str, Any]:
        """The flat form the key hashes and baseline_key.json keeps: the fields, then the settings beside them."""
        fixed = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        del fixed["settings"]
        if self.eval_sample is None:  # key format 1 had none
            del fixed["eval_sample"]
        return {**fixed, **self.settings}


@dataclass(frozen=True)
class KeyRecord(OpenDocument):
    """`baseline_key.json`, beside a baseline's output: its key and key parts, the run that planned it and when, to
    explain a later mismatch and to say which run trained a reused baseline (read with `from_json(value, url)`, which
    names the file and the field; keys a later version adds are kept)."""

    key: str
    parts: KeyParts
    trained_by_run: str
    planned_at: str


def code_version() -> str:
    """The fingerprint of the workers' Python sources (paths and contents): the trainer's and the core's."""
    return code_fingerprint({folder: [str(path)] for folder, path in WORKER_SOURCES.items()})["fingerprint"]


def baseline_key_parts(cfg: RunConfig, manifest: Mapping[str, Any], total_steps: int) -> KeyParts:
    """Everything that changes the baseline's result."""
    baseline_cfg = cfg.baseline_config()
    return KeyParts(
        key_format_version=KEY_FORMAT_VERSION,
        dataset_fingerprint=manifest["fingerprint"],
        tokenizer_fingerprint=manifest["tokenizer"]["fingerprint"],
        eval_sample=sample_identity(manifest, cfg.eval_tokens)["id"],
        global_batch_size=baseline_cfg.global_batch_size,
        steps=total_steps,
        code_version=code_version(),
        libraries=package_versions(NUMERIC_LIBRARIES),
        settings={name: value for name, value in baseline_cfg.settings().items() if name not in _NOT_IN_KEY},
    )


def baseline_key(cfg: RunConfig, manifest: dict, total_steps: int) -> str:
    """A stable name for the baseline of this run: equal keys mean interchangeable baselines."""
    parts = baseline_key_parts(cfg, manifest, total_steps)
    digest = hashlib.sha256(json.dumps(parts.to_json(), sort_keys=True).encode()).hexdigest()
    model_name = safe_name(cfg.model.rstrip("/").rsplit("/", 1)[-1], 40) or "model"
    return f"{model_name}-gb{parts.global_batch_size}-s{total_steps}-{digest[:16]}"


@uses_run_storage
def plan_baseline(prepared: PreparedRun, own: OwnRun) -> bool:
    """True when the `baseline` task must train; False skips it (policy `skip`, or a matching baseline exists).

    `run` clears the old output first so its summary.json cannot pass for the new one. Every URL is the run's own
    (tasks/checked_run.py), checked before anything is read or deleted.
    """
    checked = checked_run(prepared, own)
    cfg, key, baseline = checked.cfg, checked.baseline_key, checked.baseline
    if cfg.baseline == "skip":
        log.info("Baseline policy 'skip': no baseline, the report will have no speedup or loss parity.")
        return False

    manifest = read_json(checked.manifest_url)
    parts = baseline_key_parts(cfg, manifest, cfg.max_steps)
    if baseline_key(cfg, manifest, cfg.max_steps) != key:
        raise RuntimeError(
            f"Baseline key {key} from the prepare task no longer matches this run's settings and trainer code "
            f"(the trainer/ sources changed between tasks?): clear the run and trigger it again."
        )
    if cfg.baseline == "run":
        log.info("Baseline policy 'run': training baseline %s again; clearing %s first.", key, baseline.url)
        remove_tree(baseline.url)
        _write_key_record(baseline.url, key, parts, checked.run_id)
        return True

    if exists(baseline.summary):
        summary = TrainSummary.from_json(read_json(baseline.summary), baseline.summary)  # refused here, not later
        log.info("Baseline policy 'auto': reusing baseline %s (finished %s, %s steps in %.1f s of training) at %s.",
                 key, summary.finished_at, summary.steps, summary.train_time_s, baseline.url)
        return False
    if exists(baseline.url):
        log.info("Baseline policy 'auto': baseline %s exists without summary.json (an interrupted run); "
                 "training it, resuming from its checkpoints.", key)
    else:
        log.info("Baseline policy 'auto': no baseline with key %s; %s", key,
                 _explain_mismatch(checked.storage.baselines, key, parts))
    _write_key_record(baseline.url, key, parts, checked.run_id)
    return True


def read_key_record(baseline_url: str) -> KeyRecord | None:
    """The record written when the baseline was planned (None without one); DocumentError naming the file and the
    field when it is not one."""
    url = join(baseline_url, KEY_RECORD)
    return KeyRecord.from_json(read_json(url), url) if exists(url) else None


def _write_key_record(baseline_url: str, key: str, parts: KeyParts, run_id: str) -> None:
    record = KeyRecord(key=key, parts=parts, trained_by_run=run_id, planned_at=utc_now())
    write_json_atomic(join(baseline_url, KEY_RECORD), record.to_json())


def _explain_mismatch(baselines_url: str, key: str, parts: KeyParts) -> str:
    """Which key parts differ from the most recently planned complete baseline, so users see why it reruns (a key
    record that cannot be read is left out, saying why)."""
    candidates = []
    for name in list_dir(baselines_url):
        url = join(baselines_url, name)
        try:
            record = read_key_record(url) if name != key and exists(join(url, "summary.json")) else None
        except DocumentError as error:
            log.info("Baseline %s is not compared: %s", name, error)
            continue
        if record:
            candidates.append(record)
    if not candidates:
        return "no complete baseline exists yet, training one."
    latest = max(candidates, key=lambda record: record.planned_at)
    before, now = latest.parts.to_json(), parts.to_json()
    changed = [f"{name} ({before.get(name)!r} -> {value!r})" for name, value in now.items()
               if before.get(name) != value]
    return f"the latest complete baseline {latest.key} differs in {', '.join(changed)}; training a new one."
