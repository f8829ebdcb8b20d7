"""The kubernetes backend's factory: run settings and an Airflow connection -> clients through the provider's
hook, refused with the setting's name before anything is created."""

from __future__ import annotations

import json

import pytest
from tf_multiworker.backends import make_backend

from core.config import RunConfig
from launcher import LaunchError
from launcher.kubernetes import KubernetesBackend, KubernetesSettings
from launcher.kubernetes_objects import PodSettings
from tests.support.k8s_server import FakeKubernetes

ON_S3 = {"backend": "kubernetes", "storage_root": "s3://runs/x"}


def test_a_connection_with_a_kubeconfig_reaches_the_cluster(monkeypatch):
    with FakeKubernetes() as cluster:
        monkeypatch.setenv("AIRFLOW_CONN_MY_CLUSTER", json.dumps(
            {"conn_type": "kubernetes", "extra": {"kube_config": cluster.kubeconfig()}}))
        backend = make_backend(RunConfig.of(**ON_S3, kubernetes_conn_id="my_cluster", namespace="ml-team",
                                            use_gpu=True, gpus_per_worker=1, node_selector={"pool": "gpu"}))
        assert isinstance(backend, KubernetesBackend)
        assert (backend.settings.namespace, backend.settings.pod.gpus) == ("ml-team", 1)
        assert dict(backend.settings.pod.node_selector) == {"pool": "gpu"}
        one = make_backend(RunConfig.of(**ON_S3, kubernetes_conn_id="my_cluster", use_gpu=True))
        assert one.settings.pod.gpus == 1, "gpus_per_worker 0 means one per pod with use_gpu"
        assert backend.release("some-run", []).clean is True
        assert ("GET", "/api/v1/namespaces/ml-team/pods") in cluster.requests, "the calls reached the server"


def test_an_unknown_connection_is_refused_naming_the_setting():
    with pytest.raises(LaunchError, match="kubernetes_conn_id='no_such_cluster': no Airflow connection"):
        make_backend(RunConfig.of(**ON_S3, kubernetes_conn_id="no_such_cluster"))


def test_no_connection_outside_a_cluster_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(LaunchError, match="in-cluster configuration .*kubernetes_conn_id empty"):
        make_backend(RunConfig.of(**ON_S3))


def test_bad_settings_are_refused_before_any_client_is_made():
    """The run's config refuses a bad namespace first, naming the setting; the launcher, a library of its own, keeps
    its own check for callers without a RunConfig."""
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="'namespace' = 'Not_A_Label' is not a Kubernetes namespace name"):
        RunConfig.of(**ON_S3, kubernetes_conn_id="never_read", namespace="Not_A_Label")
    with pytest.raises(ValueError, match="namespace 'Not_A_Label' is not a DNS label"):
        KubernetesSettings(namespace="Not_A_Label", pod=PodSettings(image="trainer:1"))
