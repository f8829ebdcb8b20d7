"""Every run setting once: its section, default, JSON type, title, description and bounds, enum or pattern.

Two readers, so that nothing is written twice:
- the DAG declares one Airflow `Param` per setting from `param_kwargs(setting)` (the trigger form, `--conf`);
- `RunConfig` takes its defaults (`default`), its bounds (`RANGES`, `OPEN_BELOW`), its choices (`choices`) and its
  patterns (`pattern`) from here, and checks the rules between settings that no JSON schema can say.

The Params are flat (`{"num_workers": 4}`); `section` says where each setting lives in the nested `RunConfig`
("" for the core training settings, `launch`, `launch.ssh`, `launch.kubernetes`, `promotion`, `monitoring`). A
setting keeps its one name in both places, in the form, in `--conf` and in every error message.

Stdlib only (and the launcher's stdlib-only protocol table and Kubernetes name rules): the DAG file imports it at
parse time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from core.kubernetes_names import DNS_LABEL
from core.protocol import BACKEND_NAMES, BACKENDS

SECTIONS = ("", "launch", "launch.ssh", "launch.kubernetes", "promotion", "monitoring")

MODEL_PRESET_NAMES = ("tiny", "gpt2-124m")
EXPORT_FORMATS = ("safetensors", "saved_model")
DEFAULT_TRAINER_IMAGE = "gpt-finetune-trainer:2.21.0"  # docker/trainer.Dockerfile
# Single-value formats, as Python `re` patterns matched whole (`fullmatch`); the Params anchor them.
MODEL_NAME = r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}"  # one path segment, safe in local paths and S3 keys
REVISION = r"[A-Za-z0-9._/-]{1,255}"
QUEUE_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,199}"  # as `airflow celery worker -q` takes it (a comma splits it)
CONN_ID = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,249}"  # an Airflow connection id (no leading '-' or '.')
# A plain address: no comment, quoting, source route (`%`, `!`, `@a:`) or address literal that a mail server reads
# another way than the domain check does.
EMAIL = r"[A-Za-z0-9._+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+"
IMAGE = r"[A-Za-z0-9][A-Za-z0-9._/:@-]*"
CPU_QUANTITY = r"\d+(\.\d+)?m?"
MEMORY_QUANTITY = r"\d+(\.\d+)?([KMGTPE]i?|k)?"
ABSOLUTE_PATH = r"/.*"
TEXT_COLUMN = r"[A-Za-z0-9_][A-Za-z0-9_. -]{0,127}"  # a column or field name: nothing Markdown or HTML reads
# Longest values of free-form strings (the form, --conf and RunConfig refuse longer ones).
MAX_LOCATION = 4096  # a path or URL (Linux's PATH_MAX)
MAX_NAME = 253  # a connection id, service account, address or image reference


@dataclass(frozen=True)
class Setting:
    """One run setting.

    Attributes:
        name: the key in the Params, `--conf`, the saved config and every error message.
        section: where `RunConfig` holds it (`SECTIONS`; "" is the top level).
        default: the value when the trigger does not give one (the DAG may override a few from its environment).
        type: its JSON type: integer, number, string, boolean, array or object.
        title: the trigger form's label.
        description: the trigger form's help text.
        optional: the form may send null (a cleared field): read as empty, or as unset for `min_workers`.
        rules: the JSON-schema keywords of its bounds, choices and format (minimum, maximum, exclusiveMinimum,
            enum, pattern, minLength, maxLength, items, uniqueItems, additionalProperties).
    """

    name: str
    section: str
    default: Any
    type: str
    title: str
    description: str = ""
    optional: bool = False
    rules: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.section not in SECTIONS:
            raise ValueError(f"setting {self.name}: unknown section {self.section!r}, expected one of {SECTIONS}")
        object.__setattr__(self, "rules", MappingProxyType(dict(self.rules)))


def _s(name: str, section: str, default: Any, type_: str, title: str, description: str = "", *,
       optional: bool = False, pattern: str | None = None, **rules: Any) -> Setting:
    if pattern is not None:  # JSON schema's `pattern` searches: anchor it, and let an optional field be empty
        rules["pattern"] = f"^({pattern})?$" if optional else f"^({pattern})$"
    return Setting(name, section, default, type_, title, description, optional, rules)


_LAUNCH, _SSH, _K8S, _PROMOTION, _MONITORING = "launch", "launch.ssh", "launch.kubernetes", "promotion", "monitoring"
_STRINGS = {"type": "string"}

# In the trigger form's order (the order of the Params, the logs and the report).
SETTINGS: tuple[Setting, ...] = (
    _s("num_workers", "", 2, "integer", "Workers", "Data-parallel workers (one GPU each when use_gpu is on).",
       minimum=1, maximum=64),
    _s("min_workers", "", None, "integer", "Minimum workers",
       "A retried train task (or one with fewer usable hosts/GPUs) may continue on as few as this many workers, "
       "with more accumulation steps keeping the global batch and data order exact; empty = num_workers (off).",
       optional=True, minimum=1, maximum=64),
    _s("backend", _LAUNCH, "local", "string", "Launcher backend",
       "Where workers run: " + "; ".join(f"{name}: {meaning}" for name, meaning in BACKENDS.items()) + ".",
       enum=list(BACKEND_NAMES)),
    _s("ssh_conn_ids", _SSH, (), "array", "SSH hosts",
       "backend ssh: Airflow SSH connection ids, one per host (host-key checking on: give each its host_key "
       "extra).", optional=True, items={"type": "string", "pattern": f"^({CONN_ID})$"}),
    _s("workers_per_host", _SSH, 0, "integer", "Workers per host",
       "backend ssh: 0 = one per free GPU with use_gpu, else one per host.", minimum=0, maximum=64),
    _s("remote_python", _SSH, "", "string", "Remote Python",
       "backend ssh: absolute path of the worker environment's interpreter on the hosts; empty = the same path as "
       "on this Airflow worker.", optional=True, pattern=ABSOLUTE_PATH, maxLength=MAX_LOCATION),
    _s("remote_workdir", _SSH, "", "string", "Remote work directory",
       "backend ssh: where ranks run on each host; empty = tfmw/ under the host's temporary directory. Others only "
       "from GPT_FINETUNE_REMOTE_WORKDIRS.", optional=True, maxLength=MAX_LOCATION),
    _s("dataset", "", "data/sample/*.txt", "string", "Dataset",
       "Local path, file:// or s3:// URL (globs allowed) of .txt/.jsonl/.json/.parquet files, or a hub dataset id "
       "when online. Relative paths are from the repository; local paths only under GPT_FINETUNE_DATA_ROOTS, "
       "buckets only from GPT_FINETUNE_S3_BUCKETS.", minLength=1, maxLength=MAX_LOCATION),
    _s("text_column", "", "text", "string", "Text column",
       "Column holding the text in structured files: up to 128 letters, digits, '_', '.', '-' and spaces.",
       pattern=TEXT_COLUMN, maxLength=128),
    _s("tokenizer", "", "bpe:2048", "string", "Tokenizer",
       "bpe:<vocab> trains a byte-level BPE offline; else a hub name or a path/URL under the allowed data roots or "
       "buckets.", minLength=1, maxLength=MAX_LOCATION),
    _s("model", "", "tiny", "string", "Model",
       f"Preset for random init ({', '.join(MODEL_PRESET_NAMES)}), a hub name, a save_pretrained path/URL under the "
       "allowed data roots or buckets, or promoted / promoted:<name> to continue from the latest promoted version.",
       minLength=1, maxLength=MAX_LOCATION),
    _s("model_revision", "", "", "string", "Model revision",
       "For a hub model: the branch, tag or commit to fine-tune; empty = main. prepare pins it to the commit sha "
       "and fetches the model once into storage_root/models/base/<name>@<sha>/, which every worker loads.",
       optional=True, pattern=REVISION),
    _s("block_size", "", 64, "integer", "Block size", "Tokens per training sequence.", minimum=8, maximum=8192),
    _s("batch_size_per_worker", "", 8, "integer", "Batch per worker", minimum=1, maximum=4096),
    _s("max_steps", "", 300, "integer", "Max optimizer steps", "0 derives the step count from epochs.",
       minimum=0, maximum=10_000_000),
    _s("epochs", "", 1.0, "number", "Epochs", "Passes over the training split when max_steps is 0.",
       exclusiveMinimum=0, maximum=1000),
    _s("learning_rate", "", 3e-3, "number", "Peak learning rate", exclusiveMinimum=0, maximum=1),
    _s("warmup_steps", "", 20, "integer", "Warmup steps", minimum=0, maximum=10_000_000),
    _s("weight_decay", "", 0.01, "number", "AdamW weight decay", minimum=0, maximum=1),
    _s("grad_accum_steps", "", 1, "integer", "Gradient accumulation steps", minimum=1, maximum=1024),
    _s("mixed_precision", "", "no", "string", "Mixed precision", enum=["no", "bf16", "fp16"]),
    _s("xla", "", False, "boolean", "XLA (jit_compile)"),
    _s("adapter", "", "none", "string", "Adapter",
       "lora: freeze the base model and train low-rank adapters on its projections (only they are all-reduced, "
       "checkpointed and given AdamW states); none: train every weight.", enum=["none", "lora"]),
    _s("lora_rank", "", 8, "integer", "LoRA rank", "Rank r of each adapter (at most the adapted layer's width).",
       minimum=1, maximum=4096),
    _s("lora_alpha", "", 16.0, "number", "LoRA alpha", "The adapters' output is scaled by lora_alpha / lora_rank.",
       exclusiveMinimum=0, maximum=65536),
    _s("lora_targets", "", (), "array", "LoRA target modules",
       "Hugging Face module names to adapt (GPT-2: c_attn, c_proj, c_fc; Llama/Qwen2: q_proj, k_proj, v_proj, "
       "o_proj, gate_proj, up_proj, down_proj); empty = all of the architecture's.", optional=True,
       items={"type": "string", "pattern": r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"}, uniqueItems=True),
    _s("base_weights_dtype", "", "float32", "string", "Frozen base weights dtype",
       "adapter lora: bfloat16 stores the frozen base weights in half the memory (the adapters, their gradients "
       "and AdamW states stay float32).", enum=["float32", "bfloat16"]),
    _s("recompute", "", False, "boolean", "Recompute activations",
       "Keep only each block's input for the backward pass and recompute the rest there (tf.recompute_grad): "
       "activation memory for about a third more compute."),
    _s("use_gpu", "", False, "boolean", "Use GPUs",
       "Pin one GPU per worker; refuse to start when there are too few."),
    _s("baseline", "", "auto", "string", "Single-GPU baseline",
       "auto reuses a matching earlier baseline, run always trains one, skip none.", enum=["auto", "run", "skip"]),
    _s("loss_tolerance", "", 0.02, "number", "Eval loss parity tolerance (nats)", minimum=0, maximum=100),
    _s("storage_root", "", "storage", "string", "Storage root",
       "Local path, file:// or s3:// URL for shards, checkpoints and reports (an allowed bucket, see "
       "GPT_FINETUNE_S3_BUCKETS).", minLength=1, maxLength=MAX_LOCATION),
    _s("storage_conn_id", "", "", "string", "Storage connection",
       "Airflow connection (aws type) with S3 credentials; empty uses the environment.", optional=True,
       maxLength=MAX_NAME),
    _s("seed", "", 1234, "integer", "Seed", minimum=0, maximum=2**31 - 1),
    _s("val_fraction", "", 0.05, "number", "Validation fraction", "Share of documents held out for evaluation.",
       exclusiveMinimum=0, maximum=0.5),
    _s("eval_tokens", "", 1_000_000, "integer", "Evaluation tokens",
       "Validation tokens each model is scored on: the same sample of the split for every model of a run and every "
       "run on the same dataset, read without the rest of it; 0 = the whole split. At least one batch "
       "(8 x block_size).", minimum=0, maximum=10**12),
    _s("num_shards", "", 0, "integer", "Shards", "0 writes 4 shards per worker; else at least num_workers.",
       minimum=0, maximum=100_000),
    _s("prepare_tasks", "", 0, "integer", "Prepare tasks",
       "Mapped tasks that tokenize the dataset, at most this many at once: 0 = from the corpus size (one task below "
       "256 MB, then one per 512 MB, at most 32); 1 = all in the prepare task. The shards are the same for any "
       "value.", minimum=0, maximum=256),  # the scheduler slows with thousands of mapped tasks
    _s("prepare_unit_mb", "", 0, "integer", "Prepare unit (MB)",
       "Text per work unit (several per task; a retry redoes only unfinished units); 0 = automatic (16-256 MB). "
       "The shards are the same for any value.", minimum=0, maximum=1 << 20),
    _s("bpe_sample_mb", "", 256, "integer", "BPE sample (MB)",
       "tokenizer bpe:<n>: train on at most this much training text, sampled evenly over the corpus (BPE training "
       "memory grows with the text it counts).", minimum=1, maximum=1 << 20),
    _s("max_document_mb", "", 4, "integer", "Longest document (MB)",
       "A paragraph, JSON line or Parquet cell longer than this is cut into several documents (prepare's memory "
       "stays bounded); a JSON line over 4x this is refused.", minimum=1, maximum=1024),
    _s("checkpoint_every_steps", "", 20, "integer", "Checkpoint interval (steps)", minimum=1, maximum=10_000_000),
    _s("preemption_checkpoint_s", "", 8, "integer", "Preemption checkpoint (s)",
       "A training worker that gets SIGTERM (spot reclaim, node drain) saves a checkpoint within this many seconds "
       "and the retry resumes there (0 = off).", minimum=0, maximum=3600),
    _s("communication", "", "auto", "string", "Collective implementation", enum=["auto", "ring", "nccl"]),
    _s("allreduce_dtype", "", "float32", "string", "Gradients on the wire",
       "bfloat16 halves the bytes each step sends across the network (gradients are cast for the all-reduce only; "
       "accumulation and the update stay float32); float32 keeps exact parity with the baseline.",
       enum=["float32", "bfloat16"]),  # no float16: it would need loss scaling on the wire
    _s("allreduce_pack_mb", "", 32.0, "number", "All-reduce pack size (MiB)",
       "Gradients go out in packs of at least this size while the backward pass still runs (overlap); 0 sends one "
       "pack after it. No overlap with XLA.", minimum=0, maximum=1024),
    _s("collective_timeout_s", "", 300, "integer", "Preflight collective timeout (s)",
       "Bound on the preflight's collectives; training collectives have none (a lost peer is caught by heartbeats, "
       "a stuck one by the hang watchdog).", minimum=5, maximum=86_400),
    _s("startup_timeout_s", _LAUNCH, 180, "integer", "Worker start-up timeout (s)",
       "Time for every worker to come up and join the group.", minimum=5, maximum=86_400),
    _s("hang_timeout_s", _LAUNCH, 600, "integer", "Hang watchdog (s)",
       "End a group whose workers are alive but print nothing for this long (a hung collective); must exceed the "
       "first step's compilation.", minimum=10, maximum=7 * 86_400),
    _s("model_name", _PROMOTION, "gpt_finetune", "string", "Registered model name",
       "Promoted versions go to storage_root/models/<model_name>/v<N>/.", pattern=MODEL_NAME),
    _s("promotion_tolerance", _PROMOTION, 0.0, "number", "Promotion tolerance (nats)",
       "How much worse than the promoted version's eval loss a run may be and still be promoted (promote = auto).",
       minimum=0, maximum=100),
    _s("promote", _PROMOTION, "auto", "string", "Promotion",
       "auto: promote when the gates passed and eval loss is not worse than the promoted version's by more than "
       "promotion_tolerance; always: whenever the gates passed; never.", enum=["auto", "always", "never"]),
    _s("export_formats", _PROMOTION, EXPORT_FORMATS, "array", "Export formats",
       "Formats the model is checked in, each read back and compared with the trained model (logits within 1e-4, "
       "same greedy tokens) before it may be promoted: safetensors (the model directory itself, for transformers 5 "
       "/ PyTorch / vLLM, always written), saved_model (TF Serving). [] writes the model directory alone, unchecked.",
       items={"type": "string", "enum": list(EXPORT_FORMATS)}, uniqueItems=True),
    _s("kubernetes_conn_id", _K8S, "", "string", "Kubernetes connection",
       "Airflow connection (kubernetes type) of the cluster; empty uses the in-cluster configuration of the "
       "Airflow worker's pod.", optional=True, maxLength=MAX_NAME),
    _s("namespace", _K8S, "default", "string", "Kubernetes namespace", "Namespace of the worker pods (a DNS label).",
       pattern=DNS_LABEL),
    _s("image", _K8S, DEFAULT_TRAINER_IMAGE, "string", "Trainer image",
       "Image of the worker pods (docker/trainer.Dockerfile).", pattern=f"{IMAGE}|",
       maxLength=MAX_NAME),
    _s("gpus_per_worker", _K8S, 0, "integer", "GPUs per pod",
       "nvidia.com/gpu requested by each pod; 0 = one with use_gpu. Needs use_gpu. One GPU per worker: more are not "
       "supported yet, run more workers instead.", minimum=0, maximum=1),
    _s("cpu", _K8S, "", "string", "CPU request per pod", "e.g. 4 or 500m; empty: none.", optional=True,
       pattern=CPU_QUANTITY, maxLength=32),
    _s("memory", _K8S, "", "string", "Memory request per pod", "e.g. 16Gi; empty: none.", optional=True,
       pattern=MEMORY_QUANTITY, maxLength=32),
    _s("node_selector", _K8S, {}, "object", "Node selector",
       'Node labels the pods must match, e.g. {"nvidia.com/gpu.product": "NVIDIA-H200"}.',
       additionalProperties=_STRINGS),
    _s("tolerations", _K8S, (), "array", "Tolerations",
       'Pod tolerations in Kubernetes spelling, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": '
       '"NoSchedule"}].', items={"type": "object"}),
    _s("service_account", _K8S, "", "string", "Service account",
       "Service account of the worker pods (e.g. for storage access); empty: the namespace's default.",
       optional=True, maxLength=MAX_NAME),
    _s("keep_failed_pods", _K8S, False, "boolean", "Keep failed pods",
       "Leave failed worker pods in the cluster for debugging; everything else of the run is still deleted."),
    _s("min_predicted_efficiency", _MONITORING, 0.0, "number", "Minimum predicted scaling efficiency",
       "Preflight fails, before training, when the scaling advisor predicts num_workers below this efficiency "
       "(0 = off).", minimum=0, maximum=1),
    _s("gpu_queue", _LAUNCH, "", "string", "GPU queue",
       "Celery queue of preflight, train, baseline and evaluate (the tasks that hold gpu_slots), served by the GPU "
       "hosts' workers; empty = the default queue. A queue no worker serves leaves them queued until "
       "task_queued_timeout.", optional=True, pattern=QUEUE_NAME),
    _s("max_loss_rise", _MONITORING, 3.0, "number", "Loss divergence limit (nats)",
       "Train fails at the step whose loss lies more than this above its lowest so far (0 = off; a NaN loss always "
       "fails).", minimum=0, maximum=100),
    _s("min_throughput_ratio", _MONITORING, 0.5, "number", "Throughput warning ratio",
       "Warn (log, report, alert) when tokens/s falls below this share of the advisor's prediction or the last "
       "comparable run's (0 = off).", minimum=0, maximum=1),
    _s("alert_conn_id", _MONITORING, "", "string", "Alert connection",
       "Airflow connection (smtp type) that sends failure and throughput alerts; empty = no alerts.",
       optional=True, pattern=CONN_ID),
    _s("alert_emails", _MONITORING, (), "array", "Alert recipients",
       "E-mail addresses of the alerts; required with an alert connection.", optional=True,
       items={"type": "string", "pattern": f"^({EMAIL})$", "maxLength": MAX_NAME}),
    _s("capacity", _MONITORING, "on_demand", "string", "Capacity",
       "Which rate of the operator's pricing table (GPT_FINETUNE_PRICING) prices the run.",
       enum=["on_demand", "reserved", "spot"]),
    _s("max_idle_held_s", _MONITORING, 900, "integer", "Idle-held warning (s)",
       "Warn when a group held its GPUs this long without step progress (0 = off).", minimum=0, maximum=30 * 86_400),
    _s("reclaim_idle_after_s", _MONITORING, 0, "integer", "Reclaim idle GPUs after (s)",
       "Stop a group held this long without step progress (idle as the idle-held warning decides it): its ranks save "
       "a checkpoint if they still can, and the task fails without a retry (0 = off; at least max_idle_held_s).",
       minimum=0, maximum=30 * 86_400),
    _s("idle_gpu_util_pct", _MONITORING, 5, "integer", "Idle GPU utilization (%)",
       "GPU runs: a group without step progress is idle only while every NVML utilization sample of its GPUs over "
       "that time is below this (missing samples count as busy).", minimum=0, maximum=100),
    _s("min_cost_efficiency", _MONITORING, 0.5, "number", "Cost efficiency warning",
       "Warn when the measured scaling efficiency is below this: extra workers more than 1/E the GPU-hours per "
       "token (0 = off).", minimum=0, maximum=1),
    _s("max_release_s", _MONITORING, 300, "integer", "Release warning (s)",
       "Warn when the GPUs were free later than this after the last worker exited (0 = off).",
       minimum=0, maximum=86_400),
    _s("max_run_cost", _MONITORING, 0.0, "number", "Run budget",
       "Preflight fails when the advisor predicts the run above this cost, in the pricing table's currency "
       "(0 = off).", minimum=0, maximum=1e12),
)
BY_NAME: Mapping[str, Setting] = MappingProxyType({setting.name: setting for setting in SETTINGS})


def default(name: str) -> Any:
    return BY_NAME[name].default


def choices(name: str) -> tuple[Any, ...]:
    """The values a setting (or each item of a list setting) may take."""
    rules = BY_NAME[name].rules
    return tuple(rules["enum"] if "enum" in rules else rules["items"]["enum"])


def in_section(section: str) -> tuple[str, ...]:
    return tuple(setting.name for setting in SETTINGS if setting.section == section)


# The bounds RunConfig applies: (low, high) inclusive, and OPEN_BELOW's (low, high] for an excluded low end.
# (`min_workers`, optional, is bounded by `num_workers` in RunConfig.)
def _bounds(setting: Setting, low: str) -> tuple[float, float]:
    kind = float if setting.type == "number" else int
    return kind(setting.rules[low]), kind(setting.rules["maximum"])


RANGES: Mapping[str, tuple[float, float]] = MappingProxyType({
    s.name: _bounds(s, "minimum") for s in SETTINGS if "minimum" in s.rules and not s.optional})
OPEN_BELOW: Mapping[str, tuple[float, float]] = MappingProxyType({
    s.name: _bounds(s, "exclusiveMinimum") for s in SETTINGS if "exclusiveMinimum" in s.rules})


def value_of(config: Any, name: str) -> Any:
    """Setting `name` of a `RunConfig`, found in its section."""
    holder = config
    for part in filter(None, BY_NAME[name].section.split(".")):
        holder = getattr(holder, part)
    return getattr(holder, name)


def flat_settings(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved config's settings by name: nested by section (`RunConfig.to_dict()`) or flat (the Params' shape, as
    configs saved before the sections are). Nothing is checked here: `RunConfig.from_saved` does, and a reader of an
    earlier run's report reads what it finds."""
    flat: dict[str, Any] = {}

    def walk(mapping: Mapping[str, Any], path: str) -> None:
        for key, value in mapping.items():
            section = f"{path}.{key}" if path else key
            if section in SECTIONS and isinstance(value, Mapping):
                walk(value, section)
            else:
                flat[key] = value

    walk(saved, "")
    return flat


def _json_default(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def param_kwargs(setting: Setting, default_value: Any = None) -> dict[str, Any]:
    """The keyword arguments of the setting's Airflow `Param`: `default` first, then its JSON schema. An optional
    setting's type admits null: the trigger form refuses to submit an empty required field."""
    value = setting.default if default_value is None else default_value
    return {"default": _json_default(value), "type": ["null", setting.type] if setting.optional else setting.type,
            "title": setting.title, **({"description": setting.description} if setting.description else {}),
            **setting.rules}
