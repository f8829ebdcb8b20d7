"""The one run configuration: built once from the DAG's params, validated once, frozen, passed on.

Airflow validates only the Params it declares; keys given with `--conf` that are not declared arrive unchecked.
`RunConfig.from_params` therefore checks every key itself (unknown keys, types, ranges, cross-field rules) and
raises `ConfigError` naming the key, the value given and what is allowed, before anything expensive starts. It
also holds the locations the settings name to the access policy of its environment: the prepare task's, the one
place where that policy is checked. Every later task and every worker loads the config that prepare saved with
`RunConfig.from_saved`, which repeats the checks that depend only on the config, so a worker's environment (a
pod, an SSH host) needs none of the policy's variables: a worker loads it through `core.config.pinned`, which
refuses a file that is not the one the Airflow side checked (its sha256 is pinned in the worker's environment).

`RunConfig` holds the core training settings and one section per concern (`sections`: launch with ssh and
kubernetes, promotion, monitoring), as Model Garden nests its `ExperimentConfig`. One job per module: `schema`
(every setting's default, type, bounds, choices and format: the DAG's Params are generated from it), `core` (the
rules of model, tokenizer, data, training, promotion and monitoring), `launch` (backend, worker counts, SSH hosts,
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

from core.config import schema
from core.config.access import AccessPolicy
from core.config.core import BPE_SPEC, MODEL_PRESETS, PROMOTED_MODEL, ConfigError, check_core_settings
from core.config.launch import check_launch_settings, exact_worker_counts, resolve_communication
from core.config.schema import default
from core.config.sections import (
    SECTION_TYPES,
    KubernetesConfig,
    LaunchConfig,
    MonitoringConfig,
    PromotionConfig,
    SSHConfig,
    check_fields,
    thawed,
)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of one pipeline run: the core training settings, then the sections by concern.

    Attributes:
        num_workers: data-parallel workers (one GPU each with use_gpu).
        min_workers: the fewest a retried train task may continue on (None: num_workers).
        dataset: the corpus: a local path, file:// or s3:// URL (globs), or a hub dataset id.
        text_column: the column holding the text in structured files.
        tokenizer: bpe:<vocab> (trained here), a hub name or a path/URL.
        model: a preset, a hub name, a save_pretrained path/URL, or promoted[:<name>].
        model_revision: a hub model's branch, tag or commit; prepare pins it to the commit sha.
        block_size, batch_size_per_worker, max_steps, epochs, learning_rate, warmup_steps, weight_decay,
            grad_accum_steps, mixed_precision, xla, use_gpu, seed: the training run.
        adapter, lora_rank, lora_alpha, lora_targets, base_weights_dtype, recompute: what is trained and what
            memory it takes (LoRA adapters on a frozen base, bf16 frozen weights, recomputed activations).
        baseline: the single-worker baseline: auto (reuse a matching one), run or skip.
        loss_tolerance: the allowed eval-loss gap between the baseline and the distributed model (nats).
        storage_root: where shards, checkpoints and reports go; storage_conn_id: its S3 credentials' connection.
        val_fraction, eval_tokens: the validation split and the sample each model is scored on (0: all of it).
        num_shards, prepare_tasks, prepare_unit_mb, bpe_sample_mb, max_document_mb: how prepare writes the data.
        checkpoint_every_steps, preemption_checkpoint_s: checkpoints, and the deadline of one on SIGTERM.
        communication, allreduce_dtype, allreduce_pack_mb, collective_timeout_s: the gradient all-reduce and the
            preflight's bound on its collectives.
        launch: where and how the worker groups run (`LaunchConfig`, with `ssh` and `kubernetes`).
        promotion: what the trained model becomes (`PromotionConfig`).
        monitoring: gates, warnings, alerts and cost (`MonitoringConfig`).

    Bounds, choices and defaults are the schema's (`schema.py`); `to_dict()` is nested by section, and the Params,
    `--conf` and `settings()` name every setting flat.
    """

    num_workers: int = default("num_workers")
    min_workers: int | None = default("min_workers")
    dataset: str = default("dataset")
    text_column: str = default("text_column")
    tokenizer: str = default("tokenizer")
    model: str = default("model")
    model_revision: str = default("model_revision")
    block_size: int = default("block_size")
    batch_size_per_worker: int = default("batch_size_per_worker")
    max_steps: int = default("max_steps")
    epochs: float = default("epochs")
    learning_rate: float = default("learning_rate")
    warmup_steps: int = default("warmup_steps")
    weight_decay: float = default("weight_decay")
    grad_accum_steps: int = default("grad_accum_steps")
    mixed_precision: str = default("mixed_precision")
    xla: bool = default("xla")
    adapter: str = default("adapter")
    lora_rank: int = default("lora_rank")
    lora_alpha: float = default("lora_alpha")
    lora_targets: tuple[str, ...] = default("lora_targets")
    base_weights_dtype: str = default("base_weights_dtype")
    recompute: bool = default("recompute")
    use_gpu: bool = default("use_gpu")
    baseline: str = default("baseline")
    loss_tolerance: float = default("loss_tolerance")
    storage_root: str = default("storage_root")
    storage_conn_id: str = default("storage_conn_id")
    seed: int = default("seed")
    val_fraction: float = default("val_fraction")
    eval_tokens: int = default("eval_tokens")
    num_shards: int = default("num_shards")
    prepare_tasks: int = default("prepare_tasks")
    prepare_unit_mb: int = default("prepare_unit_mb")
    bpe_sample_mb: int = default("bpe_sample_mb")
    max_document_mb: int = default("max_document_mb")
    checkpoint_every_steps: int = default("checkpoint_every_steps")
    preemption_checkpoint_s: int = default("preemption_checkpoint_s")
    communication: str = default("communication")
    allreduce_dtype: str = default("allreduce_dtype")
    allreduce_pack_mb: float = default("allreduce_pack_mb")
    collective_timeout_s: int = default("collective_timeout_s")
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    monitoring: MonitoringConfig = field(default_factory=MonitoringConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("launch", "promotion", "monitoring"):
            kind = SECTION_TYPES[name]
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"RunConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        check_core_settings(self)
        check_launch_settings(self)

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_params(cls, params: Mapping[str, Any], policy: AccessPolicy | None = None) -> RunConfig:
        """Build from DAG params / `--conf` (flat: one key per setting): every key is checked, and the locations they
        name are held to `policy` (default: the one of this process's environment)."""
        cfg = cls.of(**params)
        (policy or AccessPolicy.from_env()).check_settings(cfg)
        return cfg

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any], *, policy: AccessPolicy | None = None) -> RunConfig:
        """Load a config that the prepare task built with `from_params` and saved (its `to_dict()`: config.json,
        the prepared run's XCom). Every key is checked again; against an access policy only when `policy` is given:
        where the policy's environment is (every Airflow task: `AccessPolicy.from_env()`), so that a config
        rewritten in XCom or storage reaches no further than the trigger form could. A worker's environment holds
        no policy (the launcher passes none on): it loads what the Airflow side checked, pinned by its digest
        (`core.config.pinned.load_pinned_config`).

        Nested (this version's `to_dict()`) or flat (the Params' shape, as runs before the sections saved it: an
        earlier run's report.json or baseline config) are both read."""
        cfg = cls.of(**schema.flat_settings(saved))
        if policy is not None:
            policy.check_settings(cfg)
        return cfg

    @classmethod
    def of(cls, **settings: Any) -> RunConfig:
        """From settings by their flat names (the Params' keys), the others at their defaults; unknown keys, types,
        bounds and rules checked, no access policy."""
        unknown = sorted(set(settings) - set(schema.BY_NAME))
        if unknown:
            raise ConfigError(
                f"Unknown run setting(s) {unknown}: allowed keys are {sorted(schema.BY_NAME)}. "
                "Check the spelling in --conf or the trigger form."
            )
        sections: dict[str, dict[str, Any]] = {section: {} for section in schema.SECTIONS}
        for name, value in settings.items():
            setting = schema.BY_NAME[name]
            # The trigger form sends null for an optional field the user cleared: empty (min_workers: unset).
            sections[setting.section][name] = setting.default if value is None and setting.optional else value
        launch = LaunchConfig(ssh=SSHConfig(**sections["launch.ssh"]),
                              kubernetes=KubernetesConfig(**sections["launch.kubernetes"]), **sections["launch"])
        return cls(launch=launch, promotion=PromotionConfig(**sections["promotion"]),
                   monitoring=MonitoringConfig(**sections["monitoring"]), **sections[""])

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name, in the schema's order, JSON-shaped: the Params' form of this config."""
        return {setting.name: thawed(schema.value_of(self, setting.name)) for setting in schema.SETTINGS}

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped and nested by section (lists, not tuples): what `from_saved` takes back."""
        return _nested(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with settings changed by their flat names (`cfg.replace(num_workers=1, export_formats=())`)."""
        return self.of(**{**self.settings(), **changes})

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
            return self.promotion.model_name
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
        settings = self.settings()
        width = max(len(name) for name in settings)
        lines = [f"{name:<{width}} = {value!r}" for name, value in settings.items()]
        lines.append(f"{'global_batch_size':<{width}} = {self.global_batch_size} (derived)")
        return lines


def _nested(config: Any) -> dict[str, Any]:
    values = {spec.name: getattr(config, spec.name) for spec in dataclasses.fields(config)}
    return {name: _nested(value) if dataclasses.is_dataclass(value) else thawed(value)
            for name, value in values.items()}


def field_names() -> list[str]:
    """Every setting's flat name, in the schema's (the trigger form's) order."""
    return [setting.name for setting in schema.SETTINGS]


__all__ = ["MODEL_PRESETS", "AccessPolicy", "ConfigError", "KubernetesConfig", "LaunchConfig", "MonitoringConfig",
           "PromotionConfig", "RunConfig", "SSHConfig", "field_names"]
