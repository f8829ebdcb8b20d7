"""The one run configuration: built once from the DAG's params, validated once, frozen, passed on.

Airflow validates only the Params it declares; keys given with `--conf` that are not declared arrive unchecked.
`RunConfig.from_params` therefore checks every key itself (unknown keys, types, ranges, cross-field rules) and
raises `ConfigError` naming the key, the value given and what is allowed, before anything expensive starts.

`dataset`, `model`, `tokenizer` and `storage_root` may name only what the operator allowed (`AccessPolicy`, from
the environment): presets, hub ids, local paths under the data roots, and `s3://` buckets on the allow-list.
Every other scheme (`http://`, ...) and every `..` is refused, so that a user who may trigger runs cannot make
the workers fetch URLs or read files of the host.

This module must stay importable without Airflow and without TensorFlow: the DAG, the tasks and every worker
use it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tf_multiworker.launcher.protocol import BACKEND_NAMES

from trainer.layout import REPO_ROOT


class ConfigError(ValueError):
    """A run setting is missing, unknown, of the wrong type or out of range."""


# Shapes of the random-init model presets; anything else in `model` is a hub id or a directory/URL
# in `save_pretrained` format.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 2, "n_embd": 64, "n_positions": 256},
    "gpt2-124m": {"n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024},
}

MIXED_PRECISION = ("no", "bf16", "fp16")
BASELINE_POLICIES = ("auto", "run", "skip")
COMMUNICATION = ("auto", "ring", "nccl")
PROMOTE_POLICIES = ("auto", "always", "never")
# `model: "promoted"` continues from the latest promoted version of `model_name`, `promoted:<name>` from another.
PROMOTED_MODEL = "promoted"
# A registered model's name: one path segment, safe in local paths and S3 keys.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
# A Celery queue as `airflow celery worker -q` takes it (a comma would split it into two queues).
QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}")
STORAGE_SCHEMES = ("", "file", "s3")
MAX_GLOBAL_BATCH = 1 << 20
MAX_GRAD_ACCUM = 1024
MAX_PREPARE_TASKS = 256  # mapped tasks of the prepare stage (the scheduler slows with thousands of them)
_BPE_SPEC = re.compile(r"^bpe:(\d+)$")

DATA_ROOTS_ENV = "GPT_FINETUNE_DATA_ROOTS"
S3_BUCKETS_ENV = "GPT_FINETUNE_S3_BUCKETS"
STORAGE_ROOT_ENV = "GPT_FINETUNE_STORAGE_ROOT"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # `gpt2`, `openai-community/gpt2`
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: not a drive letter
_GLOB_CHARS = re.compile(r"[*?\[]")
_EMAIL = re.compile(r"[^@\s,;<>]+@[^@\s,;<>]+\.[^@\s,;<>]+")
# Kubernetes formats (apimachinery validation), checked here so a bad value fails before anything is created.
DEFAULT_TRAINER_IMAGE = "gpt-finetune-trainer:2.21.0"  # docker/trainer.Dockerfile
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_CPU_QUANTITY = re.compile(r"\d+(\.\d+)?m?")
_MEMORY_QUANTITY = re.compile(r"\d+(\.\d+)?([KMGTPE]i?|k)?")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class AccessPolicy:
    """What run settings may reach, set by the operator through the environment (never by a run setting).

    data_roots: local directories that `dataset`, `model`, `tokenizer` and `storage_root` may lie under
        ($GPT_FINETUNE_DATA_ROOTS, separated by ':'; default: the repository's data/ and the storage root,
        $GPT_FINETUNE_STORAGE_ROOT or <repo>/storage). Relative entries are taken from the repository.
    s3_buckets: buckets that `s3://` settings may name ($GPT_FINETUNE_S3_BUCKETS, comma-separated; empty: any).
    """

    data_roots: tuple[str, ...]
    s3_buckets: frozenset[str]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AccessPolicy:
        configured = environ.get(DATA_ROOTS_ENV, "").strip()
        entries = configured.split(os.pathsep) if configured else [
            "data", environ.get(STORAGE_ROOT_ENV, "").strip() or "storage"]
        roots = tuple(os.path.realpath(REPO_ROOT / Path(entry.strip()).expanduser())
                      for entry in entries if entry.strip() and "://" not in entry)
        buckets = frozenset(b.strip() for b in environ.get(S3_BUCKETS_ENV, "").split(",") if b.strip())
        return cls(roots, buckets)

    def check(self, name: str, value: str, *, hub_ids: bool) -> None:
        """Refuse `value` of setting `name` unless it is a hub id (when `hub_ids`), an allowed bucket or a path
        under a data root. Presets are the caller's business."""
        if ".." in re.split(r"[/\\]", value):
            raise ConfigError(f"Setting '{name}' = {value!r} contains '..': name the location without it.")
        scheme = _URL_SCHEME.match(value)
        if scheme or "://" in value:
            kind = (scheme.group(1) if scheme else "").lower()
            if kind == "s3":
                return self._check_bucket(name, value)
            if kind == "file" and value.startswith("file:///"):
                return self._check_path(name, value[len("file://"):])
            raise ConfigError(
                f"Setting '{name}' = {value!r} uses the scheme '{kind}', which is not allowed: use a local path under "
                f"{list(self.data_roots)} (or file:///...), an s3:// URL"
                + (", or a hub id" if hub_ids else "") + "."
            )
        if hub_ids and _HUB_ID.fullmatch(value) and not _local_candidate(value).exists():
            return None
        return self._check_path(name, value, from_repo=name == "storage_root")

    def _check_bucket(self, name: str, value: str) -> None:
        bucket = urlparse(value).netloc
        if not bucket:
            raise ConfigError(f"Setting '{name}' = {value!r} names no bucket: write s3://<bucket>/<path>.")
        if self.s3_buckets and bucket not in self.s3_buckets:
            raise ConfigError(
                f"Setting '{name}' = {value!r}: bucket '{bucket}' is not allowed; allowed buckets are "
                f"{sorted(self.s3_buckets)} (${S3_BUCKETS_ENV})."
            )

    def _check_path(self, name: str, value: str, *, from_repo: bool = False) -> None:
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = REPO_ROOT / path if from_repo else _local_candidate(value)
        # A glob is checked by the directory it searches; symlinks are followed, so a link out of a root is refused.
        fixed = Path(*[part for part in path.parts[:next(
            (i for i, part in enumerate(path.parts) if _GLOB_CHARS.search(part)), len(path.parts))]])
        real = os.path.realpath(fixed)
        if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self.data_roots):
            raise ConfigError(
                f"Setting '{name}' = {value!r} is outside the allowed data roots {list(self.data_roots)}: move it "
                f"under one of them, or have the operator add its directory to ${DATA_ROOTS_ENV} (':'-separated)."
            )


def _local_candidate(value: str) -> Path:
    """The path a relative setting names, as the stages resolve it: from the cwd when it exists there, else from
    the repository."""
    path = Path(value).expanduser()
    if path.is_absolute() or glob.glob(str(path)):
        return path.absolute()
    return REPO_ROOT / path


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
    num_shards: int = 0
    # prepare (tasks/dataset): mapped tasks (0 = from the corpus size, 1 = one task), unit size, BPE sample
    prepare_tasks: int = 0
    prepare_unit_mb: int = 0
    bpe_sample_mb: int = 256
    checkpoint_every_steps: int = 20
    communication: str = "auto"
    collective_timeout_s: int = 300
    startup_timeout_s: int = 180
    hang_timeout_s: int = 600
    model_name: str = "gpt_finetune"
    promotion_tolerance: float = 0.0
    promote: str = "auto"
    # backend=kubernetes (plugins/tf_multiworker/launcher/kubernetes.py)
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

    def __post_init__(self) -> None:
        _validate(self)

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RunConfig:
        """Build from DAG params / `--conf` (or a saved `to_dict()`); every key is checked."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ConfigError(
                f"Unknown run setting(s) {unknown}: allowed keys are {sorted(known)}. "
                "Check the spelling in --conf or the trigger form."
            )
        values = dict(params)
        # The trigger form sends null for an optional field the user cleared.
        for name in ("storage_conn_id", "remote_python", "remote_workdir", "kubernetes_conn_id", "cpu", "memory",
                     "service_account", "gpu_queue", "alert_conn_id"):
            if name in values and values[name] is None:
                values[name] = ""
        for name in ("ssh_conn_ids", "alert_emails"):
            if name in values and values[name] is None:
                values[name] = ()
        return cls(**{name: _coerce(name, value, known[name]) for name, value in values.items()})

    def to_dict(self) -> dict[str, Any]:
        """JSON-shaped (lists, not tuples): what `from_params` takes back."""
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
        match = _BPE_SPEC.match(self.tokenizer)
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
        """The single-worker run with the same global batch and the same optimizer steps."""
        return self.replace(num_workers=1, grad_accum_steps=self.grad_accum_steps * self.num_workers, min_workers=None)

    def summary_lines(self) -> list[str]:
        """One `key = value` line per setting, for the single log of the config."""
        width = max(len(name) for name in self.to_dict())
        lines = [f"{name:<{width}} = {value!r}" for name, value in self.to_dict().items()]
        lines.append(f"{'global_batch_size':<{width}} = {self.global_batch_size} (derived)")
        return lines


# ---------------------------------------------------------------------------------------------------------------
# validation


def exact_worker_counts(num_workers: int, grad_accum_steps: int, lowest: int) -> list[int]:
    """Counts from `num_workers` down to `lowest` that divide the global batch's slots (num_workers x
    grad_accum_steps) within the accumulation limit, highest first: each keeps every slot's data exact."""
    slots = num_workers * grad_accum_steps
    return [n for n in range(num_workers, max(lowest, 1) - 1, -1) if slots % n == 0 and slots // n <= MAX_GRAD_ACCUM]


def _coerce(name: str, value: Any, spec: dataclasses.Field) -> Any:
    """Check a value's JSON type against the field's type; ints are accepted where floats are expected."""
    expected = spec.type if isinstance(spec.type, str) else spec.type.__name__
    if expected == "int | None":
        if value is None or isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"Setting '{name}' must be an integer or empty, got {value!r} ({type(value).__name__}).")
    if expected == "bool":
        if isinstance(value, bool):
            return value
        raise ConfigError(f"Setting '{name}' must be true or false, got {value!r} ({type(value).__name__}).")
    if expected == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(
            f"Setting '{name}' must be an integer, got {value!r} ({type(value).__name__}). "
            f"In --conf write it without quotes, e.g. {{\"{name}\": 4}}."
        )
    if expected == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise ConfigError(f"Setting '{name}' must be a finite number, got {value!r} ({type(value).__name__}).")
    if expected == "str":
        if isinstance(value, str):
            return value
        raise ConfigError(f"Setting '{name}' must be a string, got {value!r} ({type(value).__name__}).")
    if expected == "tuple[str, ...]":
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            return tuple(value)
        raise ConfigError(
            f"Setting '{name}' must be a list of strings, got {value!r} ({type(value).__name__}). "
            f"In --conf write e.g. {{\"{name}\": [\"host_a\", \"host_b\"]}}."
        )
    if expected == "dict[str, str]":
        if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            return dict(value)
        raise ConfigError(
            f"Setting '{name}' must be a map of strings to strings, got {value!r} ({type(value).__name__}), "
            f"e.g. {{\"{name}\": {{\"nvidia.com/gpu.product\": \"NVIDIA-H200\"}}}}."
        )
    if expected == "list[dict[str, Any]]":
        if isinstance(value, (list, tuple)) and all(isinstance(item, Mapping) for item in value):
            return [dict(item) for item in value]
        raise ConfigError(f"Setting '{name}' must be a list of objects, got {value!r} ({type(value).__name__}).")
    raise AssertionError(f"RunConfig field {name} has an unsupported type {expected}")


# Every numeric setting's bounds, in one table: `_validate` applies them and the DAG's Params declare the same
# minimum and maximum (tests/dags/test_gpt_finetune.py compares the two).
RANGES: dict[str, tuple[float, float]] = {
    "num_workers": (1, 64), "block_size": (8, 8192), "batch_size_per_worker": (1, 4096),
    "max_steps": (0, 10_000_000), "grad_accum_steps": (1, MAX_GRAD_ACCUM), "warmup_steps": (0, 10_000_000),
    "weight_decay": (0.0, 1.0), "loss_tolerance": (0.0, 100.0), "promotion_tolerance": (0.0, 100.0),
    "seed": (0, 2**31 - 1), "num_shards": (0, 100_000), "prepare_tasks": (0, MAX_PREPARE_TASKS),
    "prepare_unit_mb": (0, 1 << 20), "bpe_sample_mb": (1, 1 << 20), "checkpoint_every_steps": (1, 10_000_000),
    "collective_timeout_s": (5, 86_400), "startup_timeout_s": (5, 86_400), "hang_timeout_s": (10, 7 * 86_400),
    "max_loss_rise": (0.0, 100.0), "min_throughput_ratio": (0.0, 1.0), "min_predicted_efficiency": (0.0, 1.0),
    "gpus_per_worker": (0, 16), "workers_per_host": (0, 64),
}
# Bounds whose low end is excluded: (low, high].
OPEN_BELOW: dict[str, tuple[float, float]] = {"learning_rate": (0.0, 1.0), "epochs": (0.0, 1000.0),
                                              "val_fraction": (0.0, 0.5)}


def _check_range(cfg: RunConfig, name: str, low: float, high: float) -> None:
    value = getattr(cfg, name)
    if not low <= value <= high:
        raise ConfigError(f"Setting '{name}' = {value!r} is out of range: allowed is {low} to {high}.")


def _check_choice(cfg: RunConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in allowed:
        raise ConfigError(f"Setting '{name}' = {value!r} is not allowed: choose one of {list(allowed)}.")


def _check_alerts(cfg: RunConfig) -> None:
    """Recipients need a connection to send through and the other way round (the connection itself is looked up
    in prepare, where Airflow's connections are: tasks/alerts.py)."""
    bad = [address for address in cfg.alert_emails if not _EMAIL.fullmatch(address)]
    if bad:
        raise ConfigError(f"Setting 'alert_emails' has {bad}, which are not e-mail addresses (name@domain).")
    if cfg.alert_emails and not cfg.alert_conn_id:
        raise ConfigError("Setting 'alert_emails' needs 'alert_conn_id': the Airflow connection (smtp type) that "
                          "sends the alerts.")
    if cfg.alert_conn_id and not cfg.alert_emails:
        raise ConfigError(f"Setting 'alert_conn_id' = {cfg.alert_conn_id!r} needs 'alert_emails': the addresses "
                          "the alerts go to.")


def _validate(cfg: RunConfig) -> None:
    for f in dataclasses.fields(cfg):  # direct construction gets the same type checks as from_params
        _coerce(f.name, getattr(cfg, f.name), f)

    for name, (low, high) in RANGES.items():
        _check_range(cfg, name, low, high)
    for name, (low, high) in OPEN_BELOW.items():
        value = getattr(cfg, name)
        if not low < value <= high:
            raise ConfigError(f"Setting '{name}' = {value!r} is out of range: allowed is ({low:g}, {high:g}].")
    _check_alerts(cfg)
    _check_choice(cfg, "backend", BACKEND_NAMES)
    _check_choice(cfg, "mixed_precision", MIXED_PRECISION)
    _check_choice(cfg, "baseline", BASELINE_POLICIES)
    _check_choice(cfg, "communication", COMMUNICATION)
    _check_choice(cfg, "promote", PROMOTE_POLICIES)
    _check_model_name("model_name", cfg.model_name)
    if cfg.gpu_queue and not QUEUE_NAME.fullmatch(cfg.gpu_queue):
        raise ConfigError(
            f"Setting 'gpu_queue' = {cfg.gpu_queue!r} is not a queue name: letters, digits, '_', '.' and '-', starting "
            "with a letter or digit, at most 200 characters (empty: the default queue). Name the queue that the GPU "
            "hosts' Celery workers serve (`airflow celery worker -q <queue>`).")

    for name in ("dataset", "text_column", "tokenizer", "model", "storage_root"):
        if not getattr(cfg, name).strip():
            raise ConfigError(f"Setting '{name}' must not be empty.")

    scheme = urlparse(cfg.storage_root).scheme
    if scheme not in STORAGE_SCHEMES:
        raise ConfigError(
            f"Setting 'storage_root' = {cfg.storage_root!r} uses the unsupported scheme '{scheme}': "
            "use a local path, file:// or s3://."
        )
    policy = AccessPolicy.from_env()
    policy.check("dataset", cfg.dataset, hub_ids=True)
    policy.check("storage_root", cfg.storage_root, hub_ids=False)
    if cfg.promoted_source is not None:
        _check_model_name("model", cfg.promoted_source, setting_value=cfg.model)
    elif cfg.model not in MODEL_PRESETS:
        policy.check("model", cfg.model, hub_ids=True)
    if not cfg.tokenizer.startswith("bpe:"):
        policy.check("tokenizer", cfg.tokenizer, hub_ids=True)

    vocab = cfg.bpe_vocab_size
    if cfg.tokenizer.startswith("bpe:") and vocab is None:
        raise ConfigError(f"Setting 'tokenizer' = {cfg.tokenizer!r} is malformed: write bpe:<vocab size>, e.g. bpe:8192.")
    if vocab is not None and not 260 <= vocab <= 1_000_000:
        raise ConfigError(f"Setting 'tokenizer' = {cfg.tokenizer!r}: the BPE vocabulary must be 260 to 1000000.")

    preset = MODEL_PRESETS.get(cfg.model)
    if preset and cfg.block_size > preset["n_positions"]:
        raise ConfigError(
            f"Setting 'block_size' = {cfg.block_size} exceeds what model '{cfg.model}' allows "
            f"({preset['n_positions']} positions): lower 'block_size'."
        )
    if cfg.max_steps and cfg.warmup_steps >= cfg.max_steps:
        raise ConfigError(
            f"Setting 'warmup_steps' = {cfg.warmup_steps} must be below 'max_steps' = {cfg.max_steps}."
        )
    if cfg.global_batch_size > MAX_GLOBAL_BATCH:
        raise ConfigError(
            f"Global batch = batch_size_per_worker x num_workers x grad_accum_steps = "
            f"{cfg.batch_size_per_worker} x {cfg.num_workers} x {cfg.grad_accum_steps} = {cfg.global_batch_size} "
            f"exceeds {MAX_GLOBAL_BATCH}: lower one of them."
        )
    if cfg.num_shards and cfg.num_shards < cfg.num_workers:
        raise ConfigError(
            f"Setting 'num_shards' = {cfg.num_shards} is below 'num_workers' = {cfg.num_workers}: every worker "
            "needs at least one shard of its own. Raise 'num_shards' or set it to 0 (automatic)."
        )
    _validate_ssh(cfg)
    _validate_scaling(cfg)
    if cfg.communication == "nccl" and not cfg.use_gpu:
        raise ConfigError("Setting 'communication' = 'nccl' needs 'use_gpu' = true: use 'ring' or 'auto' on CPU.")
    if cfg.mixed_precision == "fp16" and not cfg.use_gpu:
        raise ConfigError("Setting 'mixed_precision' = 'fp16' needs 'use_gpu' = true: use 'bf16' or 'no' on CPU.")
    _validate_kubernetes(cfg)


def _validate_kubernetes(cfg: RunConfig) -> None:
    """The kubernetes backend's settings: formats always, the rules between them when that backend is chosen."""
    if not _DNS_LABEL.fullmatch(cfg.namespace):
        raise ConfigError(
            f"Setting 'namespace' = {cfg.namespace!r} is not a Kubernetes namespace name: a DNS label of at most 63 "
            "lowercase letters, digits and '-', starting and ending with a letter or digit."
        )
    if cfg.backend == "kubernetes" and not cfg.image.strip():
        raise ConfigError("Setting 'image' must name the trainer image for backend 'kubernetes', e.g. "
                          f"{DEFAULT_TRAINER_IMAGE!r} (docker/trainer.Dockerfile).")
    if cfg.backend == "kubernetes":
        _check_shared_storage(cfg, "backend 'kubernetes' runs workers in pods", "the pods")
    if cfg.image and not _IMAGE.fullmatch(cfg.image):
        raise ConfigError(f"Setting 'image' = {cfg.image!r} is not an image reference (registry/name:tag).")
    if cfg.gpus_per_worker and not cfg.use_gpu:
        raise ConfigError(f"Setting 'gpus_per_worker' = {cfg.gpus_per_worker} needs 'use_gpu' = true: set use_gpu, "
                          "or gpus_per_worker to 0 on CPU.")
    if cfg.gpus_per_worker and cfg.backend != "kubernetes":
        raise ConfigError(f"Setting 'gpus_per_worker' = {cfg.gpus_per_worker} applies to backend 'kubernetes' only "
                          f"(backend is {cfg.backend!r}): set it to 0.")
    if cfg.cpu and not _CPU_QUANTITY.fullmatch(cfg.cpu):
        raise ConfigError(f"Setting 'cpu' = {cfg.cpu!r} is not a CPU quantity: write cores ('4', '0.5') or "
                          "millicores ('500m'), or leave it empty for no request.")
    if cfg.memory and not _MEMORY_QUANTITY.fullmatch(cfg.memory):
        raise ConfigError(f"Setting 'memory' = {cfg.memory!r} is not a memory quantity: write e.g. '16Gi' or "
                          "'512Mi', or leave it empty for no request.")
    for key, value in cfg.node_selector.items():
        prefix, _, label = key.rpartition("/")
        if (prefix and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix))) or \
                not _LABEL_NAME.fullmatch(label) or not _LABEL_VALUE.fullmatch(value):
            raise ConfigError(f"Setting 'node_selector' entry {key!r}: {value!r} is not a Kubernetes label: keys "
                              "are [prefix/]name, values at most 63 letters, digits, '-', '_' or '.'.")
    allowed = {"key", "operator", "value", "effect", "tolerationSeconds"}
    for toleration in cfg.tolerations:
        unknown = sorted(set(toleration) - allowed)
        if unknown:
            raise ConfigError(f"Setting 'tolerations' entry {toleration!r} has unknown keys {unknown}: allowed are "
                              f"{sorted(allowed)} (Kubernetes spelling).")
        if toleration.get("operator", "Equal") not in TOLERATION_OPERATORS or \
                toleration.get("effect", "") not in TOLERATION_EFFECTS:
            raise ConfigError(f"Setting 'tolerations' entry {toleration!r}: operator must be one of "
                              f"{list(TOLERATION_OPERATORS)} and effect one of {list(TOLERATION_EFFECTS)}.")
        if not all(isinstance(toleration.get(k, ""), str) for k in ("key", "value")) or \
                not isinstance(toleration.get("tolerationSeconds", 0), int):
            raise ConfigError(f"Setting 'tolerations' entry {toleration!r}: key and value are strings, "
                              "tolerationSeconds an integer.")
    if cfg.service_account and not (len(cfg.service_account) <= 253
                                    and _DNS_SUBDOMAIN.fullmatch(cfg.service_account)):
        raise ConfigError(f"Setting 'service_account' = {cfg.service_account!r} is not a service account name "
                          "(lowercase letters, digits, '-' and '.').")


def _validate_scaling(cfg: RunConfig) -> None:
    """`min_workers`: elastic recovery on fewer workers."""
    if cfg.min_workers is None or cfg.min_workers == cfg.num_workers:
        return
    if not 1 <= cfg.min_workers <= cfg.num_workers:
        raise ConfigError(f"Setting 'min_workers' = {cfg.min_workers} is out of range: allowed is 1 to 'num_workers' "
                          f"= {cfg.num_workers}, or empty for {cfg.num_workers} (no recovery on fewer workers).")
    slots = cfg.num_workers * cfg.grad_accum_steps
    fewer = exact_worker_counts(cfg.num_workers, cfg.grad_accum_steps, cfg.min_workers)[1:]
    if not fewer:
        possible = exact_worker_counts(cfg.num_workers, cfg.grad_accum_steps, 1)[1:]
        raise ConfigError(
            f"Setting 'min_workers' = {cfg.min_workers}: no worker count from {cfg.min_workers} to "
            f"{cfg.num_workers - 1} splits the global batch's {slots} slots (num_workers x grad_accum_steps = "
            f"{cfg.num_workers} x {cfg.grad_accum_steps}) exactly; possible counts below {cfg.num_workers} are "
            f"{possible or 'none'}: set 'min_workers' to one of them, or leave it empty.")
    if cfg.effective_num_shards < slots:
        raise ConfigError(
            f"Setting 'min_workers' = {cfg.min_workers} needs the per-slot data order, one shard per slot of the "
            f"global batch: 'num_shards' = {cfg.effective_num_shards} is below num_workers x grad_accum_steps = "
            f"{slots}: raise 'num_shards' to at least {slots}.")


def _check_model_name(name: str, value: str, *, setting_value: str | None = None) -> None:
    if not _MODEL_NAME.fullmatch(value):
        raise ConfigError(
            f"Setting '{name}' = {setting_value or value!r} names the registered model {value!r}, which is not a "
            "safe name: use 1-64 letters, digits, '_' or '-', starting with a letter or digit."
        )


_CONN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}$")


def _check_shared_storage(cfg: RunConfig, why: str, readers: str) -> None:
    """Workers that run elsewhere reach the run's files only through object storage."""
    if urlparse(cfg.storage_root).scheme != "s3":
        raise ConfigError(
            f"Setting 'storage_root' = {cfg.storage_root!r} is local, but {why}, which share no filesystem with "
            "this one: use an s3:// storage root (shards, checkpoints and results go through it).")
    for name in ("model", "tokenizer"):
        value = getattr(cfg, name)
        if name == "model" and value in MODEL_PRESETS or name == "tokenizer" and value.startswith("bpe:"):
            continue
        scheme = urlparse(value).scheme
        hub_id = not scheme and _HUB_ID.fullmatch(value) and not _local_candidate(value).exists()
        if scheme == "file" or not scheme and not hub_id:
            raise ConfigError(f"Setting '{name}' = {value!r} is a local path, which {readers} cannot read: "
                              "put it on the s3:// storage and name its URL, or use a preset or hub id.")


def _validate_ssh(cfg: RunConfig) -> None:
    """The SSH backend's settings; connection ids that Airflow does not know are refused by the prepare task."""
    if cfg.backend != "ssh":
        if cfg.ssh_conn_ids:
            raise ConfigError(f"Setting 'ssh_conn_ids' = {list(cfg.ssh_conn_ids)} is only read by backend 'ssh', "
                              f"but 'backend' = {cfg.backend!r}: set 'backend' to 'ssh' or clear 'ssh_conn_ids'.")
        return
    if not cfg.ssh_conn_ids:
        raise ConfigError("Setting 'backend' = 'ssh' needs 'ssh_conn_ids': the Airflow SSH connections of the hosts, "
                          'one per host, e.g. {"ssh_conn_ids": ["gpu_host_1", "gpu_host_2"]}.')
    for conn_id in cfg.ssh_conn_ids:
        if not _CONN_ID.match(conn_id):
            raise ConfigError(f"Setting 'ssh_conn_ids' has {conn_id!r}, which is not an Airflow connection id "
                              "(letters, digits, '_', '.', '-').")
    repeated = sorted({c for c in cfg.ssh_conn_ids if cfg.ssh_conn_ids.count(c) > 1})
    if repeated:
        raise ConfigError(f"Setting 'ssh_conn_ids' names {repeated} more than once: list each host once and set "
                          "'workers_per_host' for several workers on a host.")
    if cfg.workers_per_host and cfg.workers_per_host * len(cfg.ssh_conn_ids) != cfg.num_workers:
        raise ConfigError(
            f"'workers_per_host' = {cfg.workers_per_host} x {len(cfg.ssh_conn_ids)} host(s) in 'ssh_conn_ids' = "
            f"{cfg.workers_per_host * len(cfg.ssh_conn_ids)} workers, but 'num_workers' = {cfg.num_workers}: make "
            "them agree, or set 'workers_per_host' to 0 (one per free GPU with use_gpu, else one per host).")
    _check_shared_storage(cfg, "backend 'ssh' runs workers on other hosts", "the SSH hosts")
    if cfg.remote_python and not cfg.remote_python.startswith("/"):
        raise ConfigError(f"Setting 'remote_python' = {cfg.remote_python!r} must be an absolute path to the worker "
                          "environment's interpreter on the hosts (e.g. /opt/gpt-finetune/.venv/bin/python), or "
                          "empty for the same path as here.")


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


__all__ = ["MODEL_PRESETS", "AccessPolicy", "ConfigError", "RunConfig", "field_names"]
