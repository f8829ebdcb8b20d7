"""The Kubernetes objects of one worker group, built as official-client models by pure functions (no API calls).

Per group: a headless Service whose name is every pod's `subdomain`, so each pod gets the stable DNS name
`<pod>.<service>.<namespace>.svc` (published before the pod is Ready); one bare pod per rank; a Secret with the
storage credentials, which pods read through `envFrom` (never a literal value in a pod spec); and a NetworkPolicy
that admits only the group's own pods to the worker port (TensorFlow's gRPC channel has no authentication).
Every object carries the run's labels, so the run's objects can be found and deleted by label; the pods, the
Secret and the NetworkPolicy are owned by the Service, so deleting the Service removes the rest.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1EnvFromSource,
    V1EnvVar,
    V1LabelSelector,
    V1NetworkPolicy,
    V1NetworkPolicyIngressRule,
    V1NetworkPolicyPeer,
    V1NetworkPolicyPort,
    V1NetworkPolicySpec,
    V1ObjectMeta,
    V1OwnerReference,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
    V1Secret,
    V1SecretEnvSource,
    V1SecurityContext,
    V1Service,
    V1ServicePort,
    V1ServiceSpec,
    V1Toleration,
)

from core.kubernetes_names import MAX_NAME, TOLERATION_KEYS, is_label_value

# Every pod has its own IP, so all ranks share one fixed port (TFJob's default).
WORKER_PORT = 2222
CONTAINER_NAME = "worker"
LABEL_RUN_KEY = "tfmw/run-key"
LABEL_GROUP = "tfmw/group"
LABEL_RANK = "tfmw/rank"
ANNOTATION_RUN_KEY = "tfmw/run-key"  # the full run key, when the label had to be shortened
_RANK_SUFFIX_ROOM = 6  # "-<rank>" for ranks up to 99999
_NOT_DNS = re.compile(r"[^a-z0-9]+")
_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.-]+")


def _digest(*parts: str, chars: int = 8) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:chars]


def label_value(text: str) -> str:
    """`text` as a label value (<= 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends): unchanged when
    it already is one, else sanitized and shortened with a hash of the original, so distinct texts stay distinct."""
    if text and is_label_value(text):
        return text
    readable = _NOT_LABEL.sub("_", text)[: MAX_NAME - 11].strip("-_.")
    return f"{readable}-{_digest(text, chars=10)}" if readable else _digest(text, chars=10)


def run_selector(run_key: str) -> str:
    """The label selector of every object of a run (release deletes by it)."""
    return f"{LABEL_RUN_KEY}={label_value(run_key)}"


@dataclass(frozen=True)
class GroupNames:
    """Names and labels of one group's objects, derived from (run key, group name) only, so a retry of the same
    task finds the objects of its earlier try."""

    run_key: str
    group: str
    namespace: str

    @property
    def service(self) -> str:
        """`tfmw-<group>-<run>-<hash>`: a DNS-1035 label (a Service name starts with a letter) leaving room for
        the pods' `-<rank>`; the hash keeps runs and groups whose readable parts collide apart."""
        readable = _NOT_DNS.sub("-", f"{self.group}-{self.run_key}".lower()).strip("-")
        budget = MAX_NAME - _RANK_SUFFIX_ROOM - len("tfmw-") - len("-") - 8
        readable = readable[:budget].strip("-")
        return f"tfmw-{readable}-{_digest(self.run_key, self.group)}" if readable else \
            f"tfmw-{_digest(self.run_key, self.group)}"

    @property
    def secret(self) -> str:
        return f"{self.service}-env"

    @property
    def network_policy(self) -> str:
        return self.service

    def pod(self, rank: int) -> str:
        return f"{self.service}-{rank}"

    def address(self, rank: int) -> str:
        """The pod's stable DNS name through the headless Service."""
        return f"{self.pod(rank)}.{self.service}.{self.namespace}.svc"

    @property
    def selector_labels(self) -> dict[str, str]:
        return {LABEL_RUN_KEY: label_value(self.run_key), LABEL_GROUP: label_value(self.group)}

    @property
    def selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector_labels.items())

    def pod_labels(self, rank: int) -> dict[str, str]:
        return {**self.selector_labels, LABEL_RANK: str(rank)}

    def metadata(self, name: str, labels: Mapping[str, str] | None = None,
                 owner: V1OwnerReference | None = None) -> V1ObjectMeta:
        return V1ObjectMeta(
            name=name, namespace=self.namespace, labels=dict(labels or self.selector_labels),
            annotations={ANNOTATION_RUN_KEY: self.run_key},
            owner_references=[owner] if owner else None,
        )


@dataclass(frozen=True)
class PodSettings:
    """How every pod of a group runs: image, resources and placement on the cluster."""

    image: str
    gpus: int = 0  # nvidia.com/gpu per pod; the device plugin then scopes the GPUs (no CUDA_VISIBLE_DEVICES)
    cpu: str = ""  # request, e.g. "4" or "500m"; empty = none
    memory: str = ""  # request, e.g. "16Gi"; empty = none
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    service_account: str = ""
    grace_period_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("image must name the trainer image")
        for toleration in self.tolerations:
            unknown = set(toleration) - TOLERATION_KEYS
            if unknown:
                raise ValueError(f"toleration {dict(toleration)} has unknown keys {sorted(unknown)}: "
                                 f"allowed {sorted(TOLERATION_KEYS)}")


def owner_reference(service_name: str, service_uid: str) -> V1OwnerReference:
    """Ownership by the group's Service (its uid exists once the Service is created). No blockOwnerDeletion: it
    would need RBAC on the Service's finalizers for nothing the launcher relies on."""
    return V1OwnerReference(api_version="v1", kind="Service", name=service_name, uid=service_uid)


def service(names: GroupNames) -> V1Service:
    return V1Service(
        api_version="v1", kind="Service", metadata=names.metadata(names.service),
        spec=V1ServiceSpec(
            cluster_ip="None",
            # DNS records before the pods are Ready: ranks resolve each other while they start.
            publish_not_ready_addresses=True,
            selector=names.selector_labels,
            ports=[V1ServicePort(name="tf-worker", port=WORKER_PORT, target_port=WORKER_PORT, protocol="TCP")],
        ),
    )


def secret(names: GroupNames, secret_env: Mapping[str, str], owner: V1OwnerReference | None = None) -> V1Secret:
    return V1Secret(
        api_version="v1", kind="Secret", type="Opaque", metadata=names.metadata(names.secret, owner=owner),
        data={k: base64.b64encode(v.encode()).decode() for k, v in secret_env.items()},
    )


def network_policy(names: GroupNames, owner: V1OwnerReference | None = None) -> V1NetworkPolicy:
    group_pods = V1LabelSelector(match_labels=names.selector_labels)
    return V1NetworkPolicy(
        api_version="networking.k8s.io/v1", kind="NetworkPolicy",
        metadata=names.metadata(names.network_policy, owner=owner),
        spec=V1NetworkPolicySpec(
            pod_selector=group_pods,
            policy_types=["Ingress"],
            ingress=[V1NetworkPolicyIngressRule(
                _from=[V1NetworkPolicyPeer(pod_selector=group_pods)],
                ports=[V1NetworkPolicyPort(port=WORKER_PORT, protocol="TCP")],
            )],
        ),
    )


def _tolerations(settings: PodSettings) -> list[V1Toleration] | None:
    if not settings.tolerations:
        return None
    return [V1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
                         effect=t.get("effect"), toleration_seconds=t.get("tolerationSeconds"))
            for t in settings.tolerations]


def pod(names: GroupNames, rank: int, settings: PodSettings, command: Sequence[str], env: Mapping[str, str],
        *, with_secret: bool, owner: V1OwnerReference | None = None) -> V1Pod:
    """Rank `rank`'s pod: `env` as literal variables (never secrets: those come from the group's Secret)."""
    requests = {k: v for k, v in (("cpu", settings.cpu), ("memory", settings.memory)) if v}
    limits = {"nvidia.com/gpu": str(settings.gpus)} if settings.gpus else {}
    if settings.gpus and "CUDA_VISIBLE_DEVICES" in env:
        raise ValueError("CUDA_VISIBLE_DEVICES must not be set on a GPU pod: the device plugin scopes its GPUs")
    name = names.pod(rank)
    container = V1Container(
        name=CONTAINER_NAME,
        image=settings.image,
        command=list(command),
        env=[V1EnvVar(name=k, value=v) for k, v in env.items()],
        env_from=[V1EnvFromSource(secret_ref=V1SecretEnvSource(name=names.secret))] if with_secret else None,
        ports=[V1ContainerPort(name="tf-worker", container_port=WORKER_PORT, protocol="TCP")],
        resources=V1ResourceRequirements(requests=requests or None, limits=limits or None),
        security_context=V1SecurityContext(allow_privilege_escalation=False),
    )
    return V1Pod(
        api_version="v1", kind="Pod", metadata=names.metadata(name, names.pod_labels(rank), owner),
        spec=V1PodSpec(
            hostname=name,
            subdomain=names.service,
            restart_policy="Never",  # a failed rank fails the group; the task's retry starts a new group
            containers=[container],
            termination_grace_period_seconds=max(1, math.ceil(settings.grace_period_s)),
            node_selector=dict(settings.node_selector) or None,
            tolerations=_tolerations(settings),
            service_account_name=settings.service_account or None,
            # Workers never call the API server, and Service variables of the namespace would only add noise.
            automount_service_account_token=False,
            enable_service_links=False,
        ),
    )

