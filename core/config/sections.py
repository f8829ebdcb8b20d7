"""The sections of a `RunConfig` beside its core training settings: launch (with ssh and kubernetes), promotion and
monitoring, as Model Garden nests `ExperimentConfig(task, trainer, runtime)`.

Each section is frozen and checks its own field types when built (the rules between settings of different sections
are `RunConfig`'s). Defaults come from the schema (`schema.py`); a field keeps the setting's one name, so
`cfg.launch.kubernetes.namespace` is the setting `namespace` of the trigger form, `--conf` and every message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from core.config.core import coerce
from core.config.schema import default


def _frozen(value: Any) -> Any:
    """A read-only copy of a JSON value: objects as read-only mappings, arrays as tuples (as `GroupSpec.env`)."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: _frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    return value


def thawed(value: Any) -> Any:
    """The JSON shape of a frozen value: dicts and lists."""
    if isinstance(value, Mapping):
        return {key: thawed(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thawed(item) for item in value]
    return value


def check_fields(config: Any) -> None:
    """Check each setting's JSON type and store it frozen (direct construction and `replace` get `from_saved`'s
    checks); sub-sections are checked by their own `__post_init__`."""
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if dataclasses.is_dataclass(value):
            continue
        object.__setattr__(config, spec.name, _frozen(coerce(spec.name, value, spec)))


@dataclass(frozen=True)
class SSHConfig:
    """backend ssh: the hosts and how ranks run there.

    Attributes:
        ssh_conn_ids: Airflow SSH connections, one per host, in rank order.
        workers_per_host: ranks per host; 0: one per free GPU with use_gpu, else one.
        remote_python: the worker environment's interpreter on the hosts; empty: the same path as here.
        remote_workdir: where ranks run on each host; empty: tfmw/ under the host's temporary directory.
    """

    ssh_conn_ids: tuple[str, ...] = default("ssh_conn_ids")
    workers_per_host: int = default("workers_per_host")
    remote_python: str = default("remote_python")
    remote_workdir: str = default("remote_workdir")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class KubernetesConfig:
    """backend kubernetes: one pod per worker.

    Attributes:
        kubernetes_conn_id: the cluster's Airflow connection; empty: the in-cluster configuration.
        namespace: the pods' namespace.
        image: the trainer image the pods run.
        gpus_per_worker: nvidia.com/gpu each pod requests; 0: one with use_gpu.
        cpu: each pod's CPU request; empty: none.
        memory: each pod's memory request; empty: none.
        node_selector: node labels the pods must match (read-only).
        tolerations: pod tolerations in Kubernetes spelling (read-only).
        service_account: the pods' service account; empty: the namespace's default.
        keep_failed_pods: leave a failed pod in the cluster for debugging.
    """

    kubernetes_conn_id: str = default("kubernetes_conn_id")
    namespace: str = default("namespace")
    image: str = default("image")
    gpus_per_worker: int = default("gpus_per_worker")
    cpu: str = default("cpu")
    memory: str = default("memory")
    node_selector: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    tolerations: tuple[Mapping[str, Any], ...] = default("tolerations")
    service_account: str = default("service_account")
    keep_failed_pods: bool = default("keep_failed_pods")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class LaunchConfig:
    """Where and how the worker groups run.

    Attributes:
        backend: local processes, SSH hosts or Kubernetes pods (`core.protocol.BACKENDS`).
        startup_timeout_s: time for every worker to come up and join the group.
        hang_timeout_s: end a group whose workers print nothing for this long.
        gpu_queue: the Celery queue of the tasks that hold gpu_slots; empty: the default queue.
        ssh: the ssh backend's settings.
        kubernetes: the kubernetes backend's settings.
    """

    backend: str = default("backend")
    startup_timeout_s: int = default("startup_timeout_s")
    hang_timeout_s: int = default("hang_timeout_s")
    gpu_queue: str = default("gpu_queue")
    ssh: SSHConfig = field(default_factory=SSHConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        for name, kind in (("ssh", SSHConfig), ("kubernetes", KubernetesConfig)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"LaunchConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class PromotionConfig:
    """What a trained model becomes.

    Attributes:
        model_name: the registered model its promoted versions join.
        promotion_tolerance: how much worse than the promoted version's eval loss still promotes (promote auto).
        promote: auto, always (when the gates passed) or never.
        export_formats: serving formats written and checked for parity before promotion (trainer/export.py).
    """

    model_name: str = default("model_name")
    promotion_tolerance: float = default("promotion_tolerance")
    promote: str = default("promote")
    export_formats: tuple[str, ...] = default("export_formats")

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class MonitoringConfig:
    """Watching the run, not its numbers: gates before training, warnings, alerts and what the GPU time costs.

    Attributes:
        min_predicted_efficiency: preflight fails when the advisor predicts less (0: off).
        max_loss_rise: train fails when the loss rises this far above its lowest (0: off).
        min_throughput_ratio: warn below this share of the expected tokens/s (0: off).
        alert_conn_id: the Airflow connection (smtp) alerts go through; empty: no alerts.
        alert_emails: the alerts' recipients.
        capacity: which rate of the pricing table prices the run.
        max_idle_held_s: warn when a group held its GPUs this long without progress (0: off).
        reclaim_idle_after_s: stop a group idle this long and fail its task without a retry (0: off).
        idle_gpu_util_pct: on GPU runs, such a group is idle only while its GPUs' utilization stays below this.
        min_cost_efficiency: warn below this measured scaling efficiency (0: off).
        max_release_s: warn when the GPUs were free later than this after the last worker exited (0: off).
        max_run_cost: preflight fails when the predicted cost is above this (0: off).
    """

    min_predicted_efficiency: float = default("min_predicted_efficiency")
    max_loss_rise: float = default("max_loss_rise")
    min_throughput_ratio: float = default("min_throughput_ratio")
    alert_conn_id: str = default("alert_conn_id")
    alert_emails: tuple[str, ...] = default("alert_emails")
    capacity: str = default("capacity")
    max_idle_held_s: int = default("max_idle_held_s")
    reclaim_idle_after_s: int = default("reclaim_idle_after_s")
    idle_gpu_util_pct: int = default("idle_gpu_util_pct")
    min_cost_efficiency: float = default("min_cost_efficiency")
    max_release_s: int = default("max_release_s")
    max_run_cost: float = default("max_run_cost")

    def __post_init__(self) -> None:
        check_fields(self)


SECTION_TYPES = {"launch": LaunchConfig, "launch.ssh": SSHConfig, "launch.kubernetes": KubernetesConfig,
                 "promotion": PromotionConfig, "monitoring": MonitoringConfig}
