"""The one run configuration: built once from the DAG's params, validated once, frozen, passed on.

Airflow validates only the Params it declares; keys given with `--conf` that are not declared arrive unchecked.
`RunConfig.from_params` therefore checks every key itself (unknown keys, types, ranges, cross-field rules) and
raises `ConfigError` naming the key, the value given and what is allowed, before anything expensive starts. It
also holds the locations the settings name to the access policy of its environment: the prepare task's, the one
place where that policy is checked. Every later task and every worker loads the config that prepare saved with
`RunConfig.from_saved`, which repeats the checks that depend only on the config, so a worker's environment (a
pod, an SSH host) needs none of the policy's variables: a worker loads it through `trainer.config.pinned`, which
refuses a file that is not the one the Airflow side checked (its sha256 is pinned in the worker's environment).

`RunConfig` holds the fields; their rules are one job per module: `core` (model, tokenizer, data, training,
promotion and monitoring; the bounds of every numeric setting), `launch` (backend, worker counts, SSH hosts,
Kubernetes pods, collectives, the GPU queue) and `access` (the places settings may name, from the environment).

The package must stay importable without Airflow and without TensorFlow: the DAG, the tasks and every worker
use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.config import schema
from trainer.config.access import AccessPolicy
from trainer.config.core import (
    BPE_SPEC,
    EXPORT_FORMATS,
    MODEL_PRESETS,
    PROMOTED_MODEL,
    ConfigError,
    check_core_settings,
    coerce,
)
from trainer.config.launch import (
    DEFAULT_TRAINER_IMAGE,
    check_launch_settings,
    exact_worker_counts,
    resolve_communication,
)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of one pipeline run. Field order is the order shown in logs and reports."""

    num_workers: int = 2
    min_workers: int | None = None
    backend: str = "local"
    ssh_conn_ids: tuple[str, ...] = ()
    workers_per_host: int = 0
    remote_python: str = ""
    remote_workdir: str = ""
    dataset: str = "data/sample/*.txt"
    text_column: str = "text"
    tokenizer: str = "bpe:2048"
    model: str = "tiny"
    # A hub model's branch, tag or commit; prepare pins it to the commit sha (tasks/base_models.py). "": main.
    model_revision: str = ""
    block_size: int = 64
    batch_size_per_worker: int = 8
    max_steps: int = 300
    epochs: float = 1.0
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_accum_steps: int = 1
    mixed_precision: str = "no"
    xla: bool = False
    use_gpu: bool = False
    baseline: str = "auto"
    loss_tolerance: float = 0.02
    storage_root: str = "storage"
    storage_conn_id: str = ""
    seed: int = 1234
    val_fraction: float = 0.05
    # Validation tokens each model is evaluated on: a fixed sample of the split (trainer/eval_sample.py); 0 = all.
    eval_tokens: int = 1_000_000
    num_shards: int = 0
    # prepare (tasks/dataset): mapped tasks (0 = from the corpus size, 1 = one task), unit size, BPE sample, and the
    # longest document (a longer paragraph, JSON line or Parquet cell is cut into several: tasks/dataset/readers.py)
    prepare_tasks: int = 0
    prepare_unit_mb: int = 0
    bpe_sample_mb: int = 256
    max_document_mb: int = 4
    checkpoint_every_steps: int = 20
    # SIGTERM with notice (spot reclaim, node drain, pod deletion): every rank saves a checkpoint within this many
    # seconds and exits; the next attempt resumes there (0 = off: SIGTERM ends a worker at once). The group's grace
    # before SIGKILL (the stop ladder, a pod's terminationGracePeriodSeconds) is at least this plus a margin.
    preemption_checkpoint_s: int = 8
    communication: str = "auto"
    # Gradient communication (trainer/allreduce.py): the dtype on the wire and the all-reduce pack size (0 = one).
    allreduce_dtype: str = "float32"
    allreduce_pack_mb: float = 32.0
    collective_timeout_s: int = 300
    startup_timeout_s: int = 180
    hang_timeout_s: int = 600
    model_name: str = "gpt_finetune"
    promotion_tolerance: float = 0.0
    promote: str = "auto"
    # Serving formats written beside the TF model and checked for parity before promotion (trainer/export.py).
    export_formats: tuple[str, ...] = EXPORT_FORMATS
    # backend=kubernetes (launcher/kubernetes.py)
    kubernetes_conn_id: str = ""
    namespace: str = "default"
    image: str = DEFAULT_TRAINER_IMAGE
    gpus_per_worker: int = 0
    cpu: str = ""
    memory: str = ""
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    service_account: str = ""
    keep_failed_pods: bool = False
    min_predicted_efficiency: float = 0.0
    # The Celery queue of the tasks that hold gpu_slots (plugins/tf_multiworker/gpu_admission.py); "": the default.
    gpu_queue: str = ""
    # Monitoring (docs/monitoring.md): fail fast when the loss diverges; warn when throughput collapses; alerts.
    max_loss_rise: float = 3.0
    min_throughput_ratio: float = 0.5
    alert_conn_id: str = ""
    alert_emails: tuple[str, ...] = ()
    # GPU time and cost (tasks/usage.py, tasks/pricing.py): which rate of the operator's table applies, and the
    # warnings (0 = off) and budget (preflight fails when the advisor predicts the asked count over it).
    capacity: str = "on_demand"
    max_idle_held_s: int = 900
    idle_gpu_util_pct: int = 5
    min_cost_efficiency: float = 0.5
    max_release_s: int = 300
    max_run_cost: float = 0.0

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):  # direct construction and replace() get from_saved's checks
            coerce(spec.name, getattr(self, spec.name), spec)
        check_core_settings(self)
        check_launch_settings(self)

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_params(cls, params: Mapping[str, Any], policy: AccessPolicy | None = None) -> RunConfig:
        """Build from DAG params / `--conf`: every key is checked, and the locations they name are held to
        `policy` (default: the one of this process's environment)."""
        cfg = cls._from_mapping(params)
        (policy or AccessPolicy.from_env()).check_settings(cfg)
        return cfg

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any], *, policy: AccessPolicy | None = None) -> RunConfig:
        """Load a config that the prepare task built with `from_params` and saved (its `to_dict()`: config.json,
        the prepared run's XCom). Every key is checked again; against an access policy only when `policy` is given:
        where the policy's environment is (every Airflow task: `AccessPolicy.from_env()`), so that a config
        rewritten in XCom or storage reaches no further than the trigger form could. A worker's environment holds
        no policy (the launcher passes none on): it loads what the Airflow side checked, pinned by its digest
        (`trainer.config.pinned.load_pinned_config`)."""
        cfg = cls._from_mapping(saved)
        if policy is not None:
            policy.check_settings(cfg)
        return cfg

    @classmethod
    def _from_mapping(cls, params: Mapping[str, Any]) -> RunConfig:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ConfigError(
                f"Unknown run setting(s) {unknown}: allowed keys are {sorted(known)}. "
                "Check the spelling in --conf or the trigger form."
            )
        values = dict(params)
        # The trigger form sends null for an optional field the user cleared: empty (min_workers: unset).
        for name, value in values.items():
            if value is None and schema.BY_NAME[name].optional:
                values[name] = schema.BY_NAME[name].default
        return cls(**{name: coerce(name, value, known[name]) for name, value in values.items()})

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (lists, not tuples): what `from_saved` takes back."""
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in dataclasses.asdict(self).items()}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    # -- derived values ----------------------------------------------------------------------------------------

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step across all workers."""
        return self.batch_size_per_worker * self.num_workers * self.grad_accum_steps

    @property
    def lowest_worker_count(self) -> int:
        """The fewest workers a retried train task may continue on (`min_workers`; unset: `num_workers`)."""
        return self.num_workers if self.min_workers is None else self.min_workers

    @property
    def elastic_worker_counts(self) -> list[int]:
        """Worker counts this run may train on, highest first: from `num_workers` down to `min_workers`, those
        that split the global batch exactly (count x accumulation == num_workers x grad_accum_steps)."""
        return exact_worker_counts(self.num_workers, self.grad_accum_steps, self.lowest_worker_count)

    def for_workers(self, count: int, **changes: Any) -> RunConfig:
        """The same run (same global batch, same per-slot data order) on `count` workers with more accumulation."""
        slots = self.num_workers * self.grad_accum_steps
        if count not in exact_worker_counts(self.num_workers, self.grad_accum_steps, 1):
            raise ConfigError(f"{count} workers cannot split {slots} slots of the global batch exactly.")
        return self.replace(num_workers=count, grad_accum_steps=slots // count,
                            min_workers=None if self.min_workers is None else min(self.min_workers, count),
                            **changes)

    @property
    def collective_implementation(self) -> str:
        """What `communication` runs as: 'nccl' or 'ring' (`auto`: NCCL with `use_gpu`, else ring)."""
        return resolve_communication(self.communication, self.use_gpu)

    @property
    def is_preset_model(self) -> bool:
        return self.model in MODEL_PRESETS

    @property
    def promoted_source(self) -> str | None:
        """The registered model name `model` continues from (`promoted`, `promoted:<name>`), else None."""
        if self.model == PROMOTED_MODEL:
            return self.model_name
        prefix = PROMOTED_MODEL + ":"
        return self.model[len(prefix):] if self.model.startswith(prefix) else None

    @property
    def bpe_vocab_size(self) -> int | None:
        """Vocabulary size when the tokenizer is trained here (`bpe:<n>`), else None."""
        match = BPE_SPEC.match(self.tokenizer)
        return int(match.group(1)) if match else None

    @property
    def effective_num_shards(self) -> int:
        """Shards to write: the explicit setting, or 4 per worker so any later worker count up to 4x divides."""
        return self.num_shards or 4 * self.num_workers

    def steps_for(self, train_sequences: int) -> int:
        """Optimizer steps of this run: `max_steps` when set, else `epochs` passes over the training split."""
        if self.max_steps:
            return self.max_steps
        if train_sequences <= 0:
            raise ConfigError("The training split has no sequences: cannot derive steps from 'epochs'.")
        return max(1, math.ceil(self.epochs * train_sequences / self.global_batch_size))

    def baseline_config(self) -> RunConfig:
        """The single-worker run with the same global batch and the same optimizer steps (it exports nothing: only
        the run's own model is promoted)."""
        return self.replace(num_workers=1, grad_accum_steps=self.grad_accum_steps * self.num_workers, min_workers=None,
                            export_formats=())

    def summary_lines(self) -> list[str]:
        """One `key = value` line per setting, for the single log of the config."""
        width = max(len(name) for name in self.to_dict())
        lines = [f"{name:<{width}} = {value!r}" for name, value in self.to_dict().items()]
        lines.append(f"{'global_batch_size':<{width}} = {self.global_batch_size} (derived)")
        return lines


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


__all__ = ["MODEL_PRESETS", "AccessPolicy", "ConfigError", "RunConfig", "field_names"]
