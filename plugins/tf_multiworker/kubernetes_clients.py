"""The kubernetes backend's API clients from an Airflow connection, through the cncf.kubernetes provider's hook.

The launcher never imports Airflow: this module turns `kubernetes_conn_id` into ready `CoreV1Api` and
`NetworkingV1Api` clients (an empty id means the in-cluster configuration of the pod the task runs in) and the
run's settings into a `KubernetesBackend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launcher.errors import LaunchError

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api, NetworkingV1Api

    from core.config import RunConfig
    from launcher.kubernetes import KubernetesBackend


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


def kubernetes_backend(cfg: RunConfig) -> KubernetesBackend:
    """The backend for a run's `launch.kubernetes` settings (and `use_gpu`)."""
    from launcher.kubernetes import KubernetesBackend, KubernetesSettings
    from launcher.kubernetes_objects import PodSettings

    pods = cfg.launch.kubernetes
    try:
        pod = PodSettings(image=pods.image, gpus=pods.gpus_per_worker or (1 if cfg.use_gpu else 0), cpu=pods.cpu,
                          memory=pods.memory, node_selector=pods.node_selector, tolerations=pods.tolerations,
                          service_account=pods.service_account)
        backend_settings = KubernetesSettings(namespace=pods.namespace, pod=pod, keep_failed_pods=pods.keep_failed_pods,
                                              conn_id=pods.kubernetes_conn_id)
    except ValueError as error:
        raise LaunchError(f"backend kubernetes: {error}") from None
    core, networking = kubernetes_clients(backend_settings.conn_id)
    return KubernetesBackend(core, networking, backend_settings)
