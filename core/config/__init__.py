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
(how a setting is declared on its field, and the `Setting` records the DAG's Params and docs/settings.md come
from), `core` (field types, and the rules of model, tokenizer, data, training, promotion and monitoring), `launch`
(backend, worker counts, SSH hosts, Kubernetes pods, collectives, the GPU queue) and `access` (the places settings
may name, from the environment).

The package must stay importable without Airflow and without TensorFlow: the DAG (at parse time, for its Params),
the tasks and every worker use it.
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
from core.config.schema import (
    LORA_TARGET,
    MAX_GRAD_ACCUM,
    MAX_LOCATION,
    MAX_NAME,
    MODEL_PRESET_NAMES,
    REVISION,
    TEXT_COLUMN,
    setting,
    thawed,
)
from core.config.sections import (
    SECTION_TYPES,
    KubernetesConfig,
    LaunchConfig,
    MonitoringConfig,
    PromotionConfig,
    SSHConfig,
    check_fields,
)


@dataclass(frozen=True)
class RunConfig:
    """Every setting of one pipeline run: the core training settings, then the sections by concern (`launch` with
    `ssh` and `kubernetes`, `promotion`, `monitoring`).

    Each field is a setting declared once with `setting()`: its default, title, description, bounds, choices and
    format; the annotation is its type. `to_dict()` is nested by section; the Params, `--conf` and `settings()`
    name every setting flat.
    """

    num_workers: int = setting(2, "Workers", "Data-parallel workers (one GPU each when use_gpu is on).", minimum=1,
        maximum=64)
    min_workers: int | None = setting(None, "Minimum workers",
        "A retried train task (or one with fewer usable hosts/GPUs) may continue on as few as this many workers, "
        "with more accumulation steps keeping the global batch and data order exact; empty = num_workers (off).",
        optional=True, minimum=1, maximum=64, allowed="at most `num_workers`, dividing its work exactly",
        see="[elastic recovery](scaling.md#elastic-recovery-on-fewer-workers)")
    dataset: str = setting("data/sample/*.txt", "Dataset",
        "Local path, file:// or s3:// URL (globs allowed) of .txt/.jsonl/.json/.parquet files, or a hub dataset id "
        "when online. Relative paths are from the repository; local paths only under GPT_FINETUNE_DATA_ROOTS, "
        "buckets only from GPT_FINETUNE_S3_BUCKETS.", minLength=1, maxLength=MAX_LOCATION,
        allowed="path, `file://` or `s3://` URL (globs), or a hub dataset id")
    text_column: str = setting("text", "Text column",
        "Column holding the text in structured files: up to 128 letters, digits, '_', '.', '-' and spaces.",
        pattern=TEXT_COLUMN, maxLength=128, allowed="1–128 letters, digits, `_`, `.`, `-`, spaces")
    tokenizer: str = setting("bpe:2048", "Tokenizer",
        "bpe:<vocab> trains a byte-level BPE offline; else a hub name or a path/URL under the allowed data roots or "
        "buckets.", minLength=1, maxLength=MAX_LOCATION, allowed="`bpe:<260–1000000>`, hub name, path/URL")
    model: str = setting("tiny", "Model",
        f"Preset for random init ({', '.join(MODEL_PRESET_NAMES)}), a hub name, a save_pretrained path/URL under the "
        "allowed data roots or buckets, or promoted / promoted:<name> to continue from the latest promoted version.",
        minLength=1, maxLength=MAX_LOCATION,
        allowed=", ".join(f"`{name}`" for name in MODEL_PRESET_NAMES)
        + ", hub name, path/URL, `promoted`, `promoted:<name>`")
    model_revision: str = setting("", "Model revision",
        "For a hub model: the branch, tag or commit to fine-tune; empty = main. prepare pins it to the commit sha "
        "and fetches the model once into storage_root/models/base/<name>@<sha>/, which every worker loads.",
        optional=True, pattern=REVISION, allowed="a branch, tag or commit sha; only with a hub name",
        see="[stages](stages.md#base-models-from-the-hub)")
    resize_embeddings: bool = setting(True, "Resize embeddings",
        "Give a checkpoint's token embedding (and untied head) one row per token of the tokenizer, new rows drawn "
        "at random; off, a tokenizer larger than the embedding is refused before launch.")
    block_size: int = setting(64, "Block size", "Tokens per training sequence.", minimum=8, maximum=8192,
        allowed="at most the model's positions")
    batch_size_per_worker: int = setting(8, "Batch per worker", "Sequences per worker per micro-step.", minimum=1,
        maximum=4096)
    max_steps: int = setting(300, "Max optimizer steps", "0 derives the step count from epochs.", minimum=0,
        maximum=10_000_000)
    epochs: float = setting(1.0, "Epochs", "Passes over the training split when max_steps is 0.", exclusiveMinimum=0,
        maximum=1000)
    learning_rate: float = setting(3e-3, "Peak learning rate", "AdamW's learning rate after the warm-up.",
        exclusiveMinimum=0, maximum=1)
    warmup_steps: int = setting(20, "Warmup steps",
        "Linear warm-up to the peak learning rate, then cosine decay to a tenth of it.", minimum=0,
        maximum=10_000_000, allowed="below `max_steps`")
    weight_decay: float = setting(0.01, "AdamW weight decay",
        "Decoupled weight decay of every weight but biases and norms (the GPT-2/3 recipe).",
        minimum=0, maximum=1)
    grad_accum_steps: int = setting(1, "Gradient accumulation steps", "Micro-steps per optimizer step.", minimum=1,
        maximum=MAX_GRAD_ACCUM)
    mixed_precision: str = setting("no", "Mixed precision",
        "The matmuls' compute dtype; weights, optimizer states, norms and the loss stay float32 (fp16 with dynamic "
        "loss scaling).", enum=["no", "bf16", "fp16"], allowed="`fp16` only with `use_gpu`", see="[model](model.md)")
    xla: bool = setting(False, "XLA (jit_compile)",
        "Compile the step with XLA: the gradients and the AdamW update, each one cluster, the all-reduce between them "
        "(so it does not overlap the backward pass).", see="[why off by default](benchmarks.md)")
    adapter: str = setting("none", "Adapter",
        "lora: freeze the base model and train low-rank adapters on its projections (only they are all-reduced, "
        "checkpointed and given AdamW states); none: train every weight.", enum=["none", "lora"])
    lora_rank: int = setting(8, "LoRA rank", "Rank r of each adapter (at most the adapted layer's width).",
        minimum=1, maximum=4096, allowed="at most the narrowest adapted layer's width")
    lora_alpha: float = setting(16.0, "LoRA alpha", "The adapters' output is scaled by lora_alpha / lora_rank.",
        exclusiveMinimum=0, maximum=65536)
    lora_targets: tuple[str, ...] = setting((), "LoRA target modules",
        "Hugging Face module names to adapt (GPT-2: c_attn, c_proj, c_fc; Llama/Qwen2: q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj); empty = all of the architecture's.", optional=True,
        items={"type": "string", "pattern": f"^({LORA_TARGET})$"}, uniqueItems=True,
        allowed="module names the model's architecture has, each once")
    base_weights_dtype: str = setting("float32", "Frozen base weights dtype",
        "adapter lora: bfloat16 stores the frozen base weights in half the memory (the adapters, their gradients "
        "and AdamW states stay float32).", enum=["float32", "bfloat16"], allowed="`bfloat16` only with `adapter` lora")
    recompute: bool = setting(False, "Recompute activations",
        "Keep only each block's input for the backward pass and recompute the rest there (tf.recompute_grad): "
        "activation memory for about a third more compute.")
    use_gpu: bool = setting(False, "Use GPUs", "Pin one GPU per worker; refuse to start when there are too few.")
    baseline: str = setting("auto", "Single-GPU baseline",
        "auto reuses a matching earlier baseline, run always trains one, skip none.", enum=["auto", "run", "skip"])
    loss_tolerance: float = setting(0.02, "Eval loss parity tolerance (nats)",
        "Allowed eval-loss gap between the baseline and the distributed model, widened by 2 standard errors of the "
        "delta when a sample of the split is evaluated (eval_tokens).", minimum=0, maximum=100)
    storage_root: str = setting("storage", "Storage root",
        "Local path, file:// or s3:// URL for shards, checkpoints and reports (an allowed bucket, see "
        "GPT_FINETUNE_S3_BUCKETS).", minLength=1, maxLength=MAX_LOCATION, allowed="path, `file://`, `s3://`")
    storage_conn_id: str = setting("", "Storage connection",
        "Airflow connection (aws type) with S3 credentials; empty uses the environment.", optional=True,
        maxLength=MAX_NAME)
    seed: int = setting(1234, "Seed", "Data order, initialisation and the validation split.", minimum=0,
        maximum=2**31 - 1)
    val_fraction: float = setting(0.05, "Validation fraction", "Share of documents held out for evaluation.",
        exclusiveMinimum=0, maximum=0.5)
    eval_tokens: int = setting(1_000_000, "Evaluation tokens",
        "Validation tokens each model is scored on: the same sample of the split for every model of a run and every "
        "run on the same dataset, read without the rest of it; 0 = the whole split. At least one batch "
        "(8 x block_size).", minimum=0, maximum=10**12, see="[evaluate](stages.md#evaluate)")
    num_shards: int = setting(0, "Shards", "0 writes 4 shards per worker; else at least num_workers.", minimum=0,
        maximum=100_000, allowed="0, or at least `num_workers`")
    prepare_tasks: int = setting(0, "Prepare tasks",
        "Mapped tasks that tokenize the dataset, at most this many at once: 0 = from the corpus size (one task below "
        "256 MB, then one per 512 MB, at most 32); 1 = all in the prepare task. The shards are the same for any "
        "value.", minimum=0, maximum=256)
    prepare_unit_mb: int = setting(0, "Prepare unit (MB)",
        "Text per work unit (several per task; a retry redoes only unfinished units); 0 = automatic (16-256 MB). "
        "The shards are the same for any value.", minimum=0, maximum=1 << 20)
    bpe_sample_mb: int = setting(256, "BPE sample (MB)",
        "tokenizer bpe:<n>: train on at most this much training text, sampled evenly over the corpus (BPE training "
        "memory grows with the text it counts).", minimum=1, maximum=1 << 20,
        allowed="at most `GPT_FINETUNE_MAX_BPE_SAMPLE_MB` (1024)")
    max_document_mb: int = setting(4, "Longest document (MB)",
        "A paragraph, JSON line or Parquet cell longer than this is cut into several documents (prepare's memory "
        "stays bounded); a JSON line over 4x this is refused.", minimum=1, maximum=1024)
    checkpoint_every_steps: int = setting(20, "Checkpoint interval (steps)",
        "Steps between checkpoints; a retried task resumes from the last one.", minimum=1, maximum=10_000_000)
    preemption_checkpoint_s: int = setting(8, "Preemption checkpoint (s)",
        "A training worker that gets SIGTERM (spot reclaim, node drain) saves a checkpoint within this many seconds "
        "and the retry resumes there (0 = off).", minimum=0, maximum=3600)
    communication: str = setting("auto", "Collective implementation",
        "auto is nccl with use_gpu, ring on the CPU; summary.json and the report say which ran.",
        enum=["auto", "ring", "nccl"], allowed="`nccl` only with `use_gpu`",
        see="[Gradient communication](scaling.md#gradient-communication)")
    allreduce_dtype: str = setting("float32", "Gradients on the wire",
        "bfloat16 halves the bytes each step sends across the network (gradients are cast for the all-reduce only; "
        "accumulation and the update stay float32); float32 keeps exact parity with the baseline.",
        enum=["float32", "bfloat16"], allowed="`bfloat16` not over NCCL, which cannot carry it",
        see="[Gradient communication](scaling.md#gradient-communication)")
    allreduce_pack_mb: float = setting(32.0, "All-reduce pack size (MiB)",
        "Gradients go out in packs of at least this size while the backward pass still runs (overlap); 0 sends one "
        "pack after it. No overlap with XLA.", minimum=0, maximum=1024)
    collective_timeout_s: int = setting(300, "Preflight collective timeout (s)",
        "Bound on the preflight's collectives; training collectives have none (a lost peer is caught by heartbeats, "
        "a stuck one by the hang watchdog).", minimum=5, maximum=86_400,
        see="[Hung collectives](stages.md#hung-collectives-in-training)")
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
        declared = schema.by_name(cls)
        unknown = sorted(set(settings) - set(declared))
        if unknown:
            raise ConfigError(
                f"Unknown run setting(s) {unknown}: allowed keys are {sorted(declared)}. "
                "Check the spelling in --conf or the trigger form."
            )
        sections: dict[str, dict[str, Any]] = {section: {} for section in schema.SECTIONS}
        for name, value in settings.items():
            setting = declared[name]
            # The trigger form sends null for an optional field the user cleared: empty (min_workers: unset).
            sections[setting.section][name] = setting.default if value is None and setting.optional else value
        launch = LaunchConfig(ssh=SSHConfig(**sections["launch.ssh"]),
                              kubernetes=KubernetesConfig(**sections["launch.kubernetes"]), **sections["launch"])
        return cls(launch=launch, promotion=PromotionConfig(**sections["promotion"]),
                   monitoring=MonitoringConfig(**sections["monitoring"]), **sections[""])

    def settings(self) -> dict[str, Any]:
        """Every setting by its flat name, in the schema's order, JSON-shaped: the Params' form of this config."""
        return {setting.name: thawed(schema.value_of(self, setting.name)) for setting in schema.declared(type(self))}

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


# Every setting its fields declare, in the trigger form's order: the DAG's Params, the log and docs/settings.md.
SETTINGS = schema.declared(RunConfig)


def field_names() -> list[str]:
    """Every setting's flat name, in the trigger form's order."""
    return [setting.name for setting in SETTINGS]


__all__ = ["MODEL_PRESETS", "SETTINGS", "AccessPolicy", "ConfigError", "KubernetesConfig", "LaunchConfig",
           "MonitoringConfig", "PromotionConfig", "RunConfig", "SSHConfig", "field_names"]
