"""The sections of a `RunConfig` beside its core training settings: launch (with ssh and kubernetes), promotion and
monitoring, as Model Garden nests `ExperimentConfig(task, trainer, runtime)`.

Each field is a setting, declared once with `setting()` (`schema.py`): default, title, description, bounds,
choices and format; the field's annotation is its type. Each section is frozen and checks its own field types when
built (the rules between settings of different sections are `RunConfig`'s). A field keeps the setting's one name,
so `cfg.launch.kubernetes.namespace` is the setting `namespace` of the trigger form, `--conf` and every message.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from core.config.core import checked_value
from core.config.schema import (
    ABSOLUTE_PATH,
    CAPACITIES,
    CONN_ID,
    CPU_QUANTITY,
    DEFAULT_TRAINER_IMAGE,
    EMAIL,
    EXPORT_FORMATS,
    IMAGE,
    MAX_LOCATION,
    MAX_NAME,
    MEMORY_QUANTITY,
    MODEL_NAME,
    QUEUE_NAME,
    setting,
)
from core.kubernetes_names import DNS_LABEL
from core.protocol import BACKEND_NAMES, BACKENDS


def _frozen(value: Any) -> Any:
    """A read-only copy of a JSON value: objects as read-only mappings, arrays as tuples (as `GroupSpec.env`)."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


def check_fields(config: Any) -> None:
    """Check each setting's JSON type and store it frozen (direct construction and `replace` get `from_saved`'s
    checks); sub-sections are checked by their own `__post_init__`."""
    hints = _hints(type(config))
    for spec in dataclasses.fields(config):
        if dataclasses.is_dataclass(hints[spec.name]):  # a section: its owner checks its type
            continue
        value = getattr(config, spec.name)
        object.__setattr__(config, spec.name, _frozen(checked_value(spec.name, value, hints[spec.name])))


@functools.cache
def _hints(config_type: type) -> dict[str, Any]:
    return typing.get_type_hints(config_type)


@dataclass(frozen=True)
class SSHConfig:
    """backend ssh: the hosts and how ranks run there."""

    ssh_conn_ids: tuple[str, ...] = setting((), "SSH hosts",
        "backend ssh: Airflow SSH connection ids, one per host (host-key checking on: give each its host_key "
        "extra).", optional=True, items={"type": "string", "pattern": f"^({CONN_ID})$"},
        allowed="Airflow connections of type `ssh`")
    workers_per_host: int = setting(0, "Workers per host",
        "backend ssh: 0 = one per free GPU with use_gpu, else one per host.", minimum=0, maximum=64,
        allowed="x hosts = `num_workers`")
    remote_python: str = setting("", "Remote Python",
        "backend ssh: absolute path of the worker environment's interpreter on the hosts; empty = the same path as "
        "on this Airflow worker.", optional=True, pattern=ABSOLUTE_PATH, maxLength=MAX_LOCATION,
        allowed="absolute path")
    remote_workdir: str = setting("", "Remote work directory",
        "backend ssh: where ranks run on each host; empty = tfmw/ under the host's temporary directory. Others only "
        "from GPT_FINETUNE_REMOTE_WORKDIRS.", optional=True, maxLength=MAX_LOCATION,
        allowed="path on `GPT_FINETUNE_REMOTE_WORKDIRS`, no `..`")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class KubernetesConfig:
    """backend kubernetes: one pod per worker."""

    kubernetes_conn_id: str = setting("", "Kubernetes connection",
        "Airflow connection (kubernetes type) of the cluster; empty uses the in-cluster configuration of the "
        "Airflow worker's pod.", optional=True, maxLength=MAX_NAME)
    namespace: str = setting("default", "Kubernetes namespace", "Namespace of the worker pods (a DNS label).",
        pattern=DNS_LABEL, allowed="DNS label")
    image: str = setting(DEFAULT_TRAINER_IMAGE, "Trainer image",
        "Image of the worker pods (docker/trainer.Dockerfile).", pattern=f"{IMAGE}|", maxLength=MAX_NAME,
        allowed="image reference")
    gpus_per_worker: int = setting(0, "GPUs per pod",
        "nvidia.com/gpu requested by each pod; 0 = one with use_gpu. Needs use_gpu. One GPU per worker: more are not "
        "supported yet, run more workers instead.", minimum=0, maximum=1, allowed="above 0 only with `use_gpu`")
    cpu: str = setting("", "CPU request per pod", "e.g. 4 or 500m; empty: none.", optional=True, pattern=CPU_QUANTITY,
        maxLength=32, allowed="e.g. `4`, `500m`")
    memory: str = setting("", "Memory request per pod", "e.g. 16Gi; empty: none.", optional=True,
        pattern=MEMORY_QUANTITY, maxLength=32, allowed="e.g. `16Gi`")
    node_selector: Mapping[str, str] = setting({}, "Node selector",
        'Node labels the pods must match, e.g. {"nvidia.com/gpu.product": "NVIDIA-H200"}.',
        additionalProperties={"type": "string"}, allowed="string to string")
    tolerations: tuple[Mapping[str, Any], ...] = setting((), "Tolerations",
        'Pod tolerations in Kubernetes spelling, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": '
        '"NoSchedule"}].', items={"type": "object"},
        allowed="Kubernetes tolerations; `tolerationSeconds` 0 to `GPT_FINETUNE_MAX_TOLERATION_S` (3600)")
    service_account: str = setting("", "Service account",
        "Service account of the worker pods (e.g. for storage access); empty: the namespace's default.", optional=True,
        maxLength=MAX_NAME)
    keep_failed_pods: bool = setting(False, "Keep failed pods",
        "Leave failed worker pods in the cluster for debugging; everything else of the run is still deleted.")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how the worker groups run."""

    backend: str = setting("local", "Launcher backend",
        "Where workers run: " + "; ".join(f"{name}: {meaning}" for name, meaning in BACKENDS.items()) + ".",
        enum=list(BACKEND_NAMES), see="[backends](backends.md)")
    startup_timeout_s: int = setting(180, "Worker start-up timeout (s)",
        "Time for every worker to come up and join the group.", minimum=5, maximum=86_400)
    hang_timeout_s: int = setting(600, "Hang watchdog (s)",
        "End a group whose workers are alive but print nothing for this long (a hung collective); must exceed the "
        "first step's compilation.", minimum=10, maximum=7 * 86_400,
        allowed="at most `GPT_FINETUNE_MAX_HANG_TIMEOUT_S` (21,600)")
    gpu_queue: str = setting("", "GPU queue",
        "Celery queue of preflight, train, baseline and evaluate (the tasks that hold gpu_slots), served by the GPU "
        "hosts' workers; empty = the default queue. A queue no worker serves leaves them queued until "
        "task_queued_timeout.", optional=True, pattern=QUEUE_NAME, allowed="a Celery queue name",
        see="[Deploying on a cluster](deployment.md#deploying-on-a-cluster)")
    ssh: SSHConfig = field(default_factory=SSHConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        for name, kind in (("ssh", SSHConfig), ("kubernetes", KubernetesConfig)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"LaunchConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class PromotionConfig:
    """What a trained model becomes."""

    model_name: str = setting("gpt_finetune", "Registered model name",
        "Promoted versions go to storage_root/models/<model_name>/v<N>/.", pattern=MODEL_NAME,
        allowed="1-64 of `A-Za-z0-9_-`, not `base`")
    promotion_tolerance: float = setting(0.0, "Promotion tolerance (nats)",
        "How much worse than the promoted version's eval loss a run may be and still be promoted (promote = auto).",
        minimum=0, maximum=100)
    promote: str = setting("auto", "Promotion",
        "auto: promote when the gates passed and eval loss is not worse than the promoted version's by more than "
        "promotion_tolerance; always: whenever the gates passed; never.", enum=["auto", "always", "never"])
    export_formats: tuple[str, ...] = setting(EXPORT_FORMATS, "Export formats",
        "Formats the model is checked in, each read back and compared with the trained model (logits within 1e-4, "
        "same greedy tokens) before it may be promoted: safetensors (the model directory itself, for transformers 5 "
        "/ PyTorch / vLLM, always written), saved_model (TF Serving). [] writes the model directory alone, unchecked.",
        items={"type": "string", "enum": list(EXPORT_FORMATS)}, uniqueItems=True,
        allowed="or `[]`; `tf_h5` is retired and refused", see="[stages](stages.md#serving-exports)")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class MonitoringConfig:
    """Watching the run, not its numbers: gates before training, warnings, alerts and what the GPU time costs."""

    min_predicted_efficiency: float = setting(0.0, "Minimum predicted scaling efficiency",
        "Preflight fails, before training, when the scaling advisor predicts num_workers below this efficiency "
        "(0 = off).", minimum=0, maximum=1)
    max_loss_rise: float = setting(3.0, "Loss divergence limit (nats)",
        "Train fails at the step whose loss lies more than this above its lowest so far (0 = off; a NaN loss always "
        "fails).", minimum=0, maximum=100)
    min_throughput_ratio: float = setting(0.5, "Throughput warning ratio",
        "Warn (log, report, alert) when tokens/s falls below this share of the advisor's prediction or the last "
        "comparable run's (0 = off).", minimum=0, maximum=1)
    alert_conn_id: str = setting("", "Alert connection",
        "Airflow connection (smtp type) that sends failure and throughput alerts; empty = no alerts.", optional=True,
        pattern=CONN_ID, allowed="an Airflow connection of type `smtp`", see="[Monitoring](monitoring.md#alerts)")
    alert_emails: tuple[str, ...] = setting((), "Alert recipients",
        "E-mail addresses of the alerts; required with an alert connection.", optional=True,
        items={"type": "string", "pattern": f"^({EMAIL})$", "maxLength": MAX_NAME},
        allowed="plain e-mail addresses (`name@domain.tld`: letters, digits and `._+-` before the `@`; no "
        "comments, quotes, `%`, `!` or `[address]`)")
    capacity: str = setting("on_demand", "Capacity",
        "Which rate of the operator's pricing table (GPT_FINETUNE_PRICING) prices the run; prepare freezes it.",
        enum=list(CAPACITIES), see="[GPU time and cost](stages.md#gpu-time-and-cost)")
    max_idle_held_s: int = setting(900, "Idle-held warning (s)",
        "Warn when a group held its GPUs this long without step progress (0 = off).", minimum=0, maximum=30 * 86_400)
    reclaim_idle_after_s: int = setting(0, "Reclaim idle GPUs after (s)",
        "Stop a group held this long without step progress (idle as the idle-held warning decides it): its ranks save "
        "a checkpoint if they still can, and the task fails without a retry (0 = off; at least max_idle_held_s).",
        minimum=0, maximum=30 * 86_400, allowed="at least `max_idle_held_s`",
        see="[Monitoring](monitoring.md#reclaiming-gpus-held-idle)")
    idle_gpu_util_pct: int = setting(5, "Idle GPU utilization (%)",
        "GPU runs: a group without step progress is idle only while every NVML utilization sample of its GPUs over "
        "that time is below this (missing samples count as busy).", minimum=0, maximum=100)
    min_cost_efficiency: float = setting(0.5, "Cost efficiency warning",
        "Warn when the measured scaling efficiency is below this: extra workers more than 1/E the GPU-hours per "
        "token (0 = off).", minimum=0, maximum=1)
    max_release_s: int = setting(300, "Release warning (s)",
        "Warn when the GPUs were free later than this after the last worker exited (0 = off).", minimum=0,
        maximum=86_400)
    max_run_cost: float = setting(0.0, "Run budget",
        "Preflight fails when the advisor predicts the run above this cost, in the pricing table's currency "
        "(0 = off).", minimum=0, maximum=1e12,
        allowed="in the table's currency; with `GPT_FINETUNE_MAX_RUN_COST` above 0, at most it")

    def __post_init__(self) -> None:
        check_fields(self)


SECTION_TYPES = {"launch": LaunchConfig, "launch.ssh": SSHConfig, "launch.kubernetes": KubernetesConfig,
                 "promotion": PromotionConfig, "monitoring": MonitoringConfig}
