"""The kubernetes backend's API clients from an Airflow connection, through the cncf.kubernetes provider's hook.

The launcher never imports Airflow: this module turns `kubernetes_conn_id` into ready `CoreV1Api` and
`NetworkingV1Api` clients (an empty id means the in-cluster configuration of the pod the task runs in) and the
run's settings into a `KubernetesBackend`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tf_multiworker.launcher.errors import LaunchError

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api, NetworkingV1Api

    from tf_multiworker.launcher.kubernetes import KubernetesBackend


def kubernetes_clients(conn_id: str) -> tuple[CoreV1Api, NetworkingV1Api]:
    """Clients for `conn_id`; LaunchError naming the setting when the connection or its configuration is bad."""
    from airflow.exceptions import AirflowNotFoundException
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook
    from kubernetes.client import NetworkingV1Api
    from kubernetes.config import ConfigException

    hook = KubernetesHook(conn_id=conn_id) if conn_id else KubernetesHook(kubernetes_conn_id=None, in_cluster=True)
    try:
        api_client = hook.api_client
    except AirflowNotFoundException:
        raise LaunchError(f"kubernetes_conn_id={conn_id!r}: no Airflow connection of that name. Create it (type "
                          "kubernetes) or leave kubernetes_conn_id empty to use the in-cluster configuration.") \
            from None
    except ConfigException as exc:
        where = f"connection {conn_id!r}" if conn_id else "the in-cluster configuration (kubernetes_conn_id empty)"
        raise LaunchError(f"kubernetes_conn_id={conn_id!r}: {where} gives no usable cluster configuration: {exc}") \
            from None
    return hook.core_v1_client, NetworkingV1Api(api_client)


def kubernetes_backend(settings: Mapping[str, Any]) -> KubernetesBackend:
    """The backend for a run's settings (a `RunConfig.to_dict()`; missing keys take their defaults)."""
    from tf_multiworker.launcher.kubernetes import KubernetesBackend, KubernetesSettings
    from tf_multiworker.launcher.kubernetes_objects import PodSettings
    from trainer.config import ConfigError, RunConfig

    try:
        cfg = RunConfig.from_params(dict(settings))
    except ConfigError as error:
        raise LaunchError(str(error)) from None
    core, networking = kubernetes_clients(cfg.kubernetes_conn_id)
    pod = PodSettings(image=cfg.image, gpus=cfg.kubernetes_gpus, cpu=cfg.cpu, memory=cfg.memory,
                      node_selector=cfg.node_selector, tolerations=tuple(cfg.tolerations),
                      service_account=cfg.service_account)
    settings = KubernetesSettings(namespace=cfg.namespace, pod=pod, keep_failed_pods=cfg.keep_failed_pods,
                                  conn_id=cfg.kubernetes_conn_id)
    return KubernetesBackend(core, networking, settings)
