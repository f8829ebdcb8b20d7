"""The rendered Pod, Service, Secret and NetworkPolicy objects: valid against the official Kubernetes OpenAPI
schema (kubernetes-validate's bundled schemas, strict: no unknown fields), plus what the schema cannot say."""

from __future__ import annotations

import base64
import json

import kubernetes_validate
import pytest
from kubernetes.client import ApiClient

from core.kubernetes_names import is_dns_label, is_label_value
from launcher import kubernetes_objects as k8s
from launcher.spec import Placement
from launcher.tf_env import tensorflow_env

# The oldest Kubernetes minor still supported upstream when this was written; strict = unknown fields are errors.
SCHEMA_VERSION = "1.33"
SECRET_ENV = {"AWS_ACCESS_KEY_ID": "AKIA-test-key-id", "AWS_SECRET_ACCESS_KEY": "s3cr3t/value+with=chars"}
LONG_RUN_KEY = "scheduled__2026-11-29T02_00_00_00_00_with_a_very_long_suffix_indeed-3f1c0a9b2e"


def plain(obj) -> dict:
    return ApiClient().sanitize_for_serialization(obj)


def render_group(run_key: str = LONG_RUN_KEY, group: str = "train", num_workers: int = 3, gpus: int = 0):
    names = k8s.GroupNames(run_key, group, "ml-team")
    settings = k8s.PodSettings(
        image="gpt-finetune-trainer:2.21.0", gpus=gpus, cpu="2", memory="8Gi",
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
        tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},),
        service_account="trainer", grace_period_s=7.5,
    )
    owner = k8s.owner_reference(names.service, "0b7e5c56-1c1f-4c55-9b0e-2f8a4f0c1d2e")
    # As the kubernetes backend places ranks: GPU pods leave GPU visibility to the device plugin.
    placements = [Placement(names.address(rank), k8s.WORKER_PORT, None if gpus else ()) for rank in range(num_workers)]
    pods = []
    for rank in range(num_workers):
        env = {"TFMW_RUN_KEY": run_key, **tensorflow_env(placements, rank)}
        pods.append(k8s.pod(names, rank, settings, ["python3", "-u", "-m", "trainer.train", "--config", "x"], env,
                            with_secret=True, owner=owner))
    return names, k8s.service(names), k8s.secret(names, SECRET_ENV, owner), k8s.network_policy(names, owner), pods


@pytest.mark.parametrize("gpus", [0, 2])
def test_every_object_is_valid_against_the_kubernetes_schema(gpus):
    _, service, secret, policy, pods = render_group(gpus=gpus)
    for obj in (service, secret, policy, *pods):
        kubernetes_validate.validate(plain(obj), SCHEMA_VERSION, strict=True)


def test_the_schema_check_catches_a_wrong_field():
    _, service, *_ = render_group()
    broken = plain(service)
    broken["spec"]["clusterIp"] = "None"  # the API spells it clusterIP
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSION, strict=True)


@pytest.mark.parametrize("run_key, group", [
    (LONG_RUN_KEY, "train"),
    ("manual__2026-11-29T15_00_00_00_00-3f1c0a9b2e", "preflight"),
    ("x" * 300, "a.task_group.with_a_long_task_id_" * 4),
    ("____", "__"),
])
def test_names_are_dns_labels_and_labels_are_label_values(run_key, group):
    names = k8s.GroupNames(run_key, group, "default")
    assert names.service[0].isalpha(), "a Service name is a DNS-1035 label: it starts with a letter"
    for name in (names.service, names.secret, names.network_policy, names.pod(0), names.pod(99999)):
        assert is_dns_label(name), name
    for value in names.pod_labels(12).values():
        assert is_label_value(value), value


def test_names_stay_distinct_for_runs_that_read_alike():
    one, other = k8s.GroupNames(LONG_RUN_KEY, "train", "ns"), k8s.GroupNames(LONG_RUN_KEY + "x", "train", "ns")
    assert one.service != other.service
    assert one.selector_labels != other.selector_labels
    assert k8s.GroupNames(LONG_RUN_KEY, "train", "ns").service == one.service, "names are deterministic"


def test_pods_resolve_each_other_through_the_headless_service():
    _, service, _, policy, pods = render_group()
    body = plain(service)
    assert body["spec"]["clusterIP"] == "None"
    assert body["spec"]["publishNotReadyAddresses"] is True
    selector = body["spec"]["selector"]
    expected_cluster = [f"{p.metadata.name}.{service.metadata.name}.ml-team.svc:{k8s.WORKER_PORT}" for p in pods]
    for rank, pod in enumerate(pods):
        spec = plain(pod)["spec"]
        assert spec["hostname"] == pod.metadata.name
        assert spec["subdomain"] == service.metadata.name
        assert spec["restartPolicy"] == "Never"
        assert selector.items() <= pod.metadata.labels.items(), "the Service selects every pod"
        assert pod.metadata.labels[k8s.LABEL_RANK] == str(rank)
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        tf_config = json.loads(env["TF_CONFIG"])
        assert tf_config == {"cluster": {"worker": expected_cluster}, "task": {"type": "worker", "index": rank}}
        assert spec["containers"][0]["ports"][0]["containerPort"] == k8s.WORKER_PORT
        assert spec["terminationGracePeriodSeconds"] == 8
        owner = pod.metadata.owner_references[0]
        assert (owner.kind, owner.name) == ("Service", service.metadata.name)
    assert policy.spec.pod_selector.match_labels == selector
    assert policy.spec.ingress[0]._from[0].pod_selector.match_labels == selector, "only the group's own pods"
    assert [p.port for p in policy.spec.ingress[0].ports] == [k8s.WORKER_PORT]


def test_secrets_reach_pods_only_through_the_secret():
    names, _, secret, _, pods = render_group()
    for pod in pods:
        text = json.dumps(plain(pod))
        for name, value in SECRET_ENV.items():
            assert value not in text, f"{name}'s value is in the pod spec of {pod.metadata.name}"
        container = plain(pod)["spec"]["containers"][0]
        assert container["envFrom"] == [{"secretRef": {"name": names.secret}}]
        assert not set(SECRET_ENV) & {e["name"] for e in container["env"]}
    assert {k: base64.b64decode(v).decode() for k, v in secret.data.items()} == SECRET_ENV


def test_gpu_pods_request_the_device_plugin_and_never_hide_its_gpus():
    *_, pods = render_group(gpus=2)
    for pod in pods:
        container = plain(pod)["spec"]["containers"][0]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        assert container["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}
        assert "CUDA_VISIBLE_DEVICES" not in {e["name"] for e in container["env"]}
    names = k8s.GroupNames("run", "train", "ns")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        k8s.pod(names, 0, k8s.PodSettings(image="img", gpus=1), ["python3"], {"CUDA_VISIBLE_DEVICES": ""},
                with_secret=False)


def test_cpu_pods_have_no_gpu_limit_and_scheduling_settings_pass_through():
    *_, pods = render_group(gpus=0)
    spec = plain(pods[0])["spec"]
    assert "limits" not in spec["containers"][0]["resources"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["serviceAccountName"] == "trainer"
    assert spec["automountServiceAccountToken"] is False


def test_a_toleration_with_an_unknown_key_is_refused():
    with pytest.raises(ValueError, match="unknown keys"):
        k8s.PodSettings(image="img", tolerations=({"key": "a", "effects": "NoSchedule"},))
