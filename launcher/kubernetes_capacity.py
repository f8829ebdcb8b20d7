"""How many worker pods the cluster can schedule now: the elastic launch's capacity on Kubernetes.

A pod fits on a node that is Ready and schedulable, has every label of the node selector, carries no NoSchedule or
NoExecute taint the pods do not tolerate, and has what the pod requests (GPUs, CPU, memory) free: allocatable less
what the node's running and pending pods already request. This is the scheduler's resource fit, not all of it
(affinity, topology spread and priorities are left out), so it can only promise too much, never too little: a pod
it counts but the scheduler cannot place stays Pending and the launch's start-up timeout names it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

from launcher import kubernetes_objects as objects

GPU_RESOURCE = "nvidia.com/gpu"
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def pod_requests(settings: objects.PodSettings) -> dict[str, Decimal]:
    """What one worker pod asks the scheduler for (the GPU limit counts as its request, as the scheduler takes it)."""
    wanted = {GPU_RESOURCE: settings.gpus, "cpu": settings.cpu, "memory": settings.memory}
    return {name: parse_quantity(str(value)) for name, value in wanted.items() if value}


def _ready(node: Any) -> bool:
    conditions = (node.status.conditions if node.status else None) or ()
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _tolerated(taint: Any, tolerations: Iterable[Mapping[str, Any]]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.effect:
            continue
        if toleration.get("operator") == "Exists" and toleration.get("key") in (None, "", taint.key):
            return True
        if toleration.get("key") == taint.key and toleration.get("value", "") == (taint.value or ""):
            return True
    return False


def blocked(node: Any, settings: objects.PodSettings) -> str | None:
    """Why no worker pod can go to `node`, or None."""
    if node.spec and node.spec.unschedulable:
        return "cordoned"
    if not _ready(node):
        return "not Ready"
    labels = node.metadata.labels or {}
    missing = [f"{k}={v}" for k, v in settings.node_selector.items() if labels.get(k) != v]
    if missing:
        return f"lacks the node_selector label(s) {missing}"
    taints = [t for t in ((node.spec.taints if node.spec else None) or ()) if t.effect in _BLOCKING_EFFECTS]
    untolerated = [f"{t.key}:{t.effect}" for t in taints if not _tolerated(t, settings.tolerations)]
    return f"has the taint(s) {untolerated} the pods do not tolerate" if untolerated else None


def requested_by_pods(pods: Iterable[Any]) -> dict[str, dict[str, Decimal]]:
    """node name -> resource -> what the pods placed there request (finished pods hold nothing)."""
    used: dict[str, dict[str, Decimal]] = {}
    for pod in pods:
        node = pod.spec.node_name if pod.spec else None
        if not node or (pod.status and pod.status.phase in ("Succeeded", "Failed")):
            continue
        for container in pod.spec.containers or ():
            resources = container.resources
            # A resource with a limit and no request is requested at its limit (Kubernetes' defaulting).
            wanted = {**(resources.limits or {}), **(resources.requests or {})} if resources else {}
            for name, value in wanted.items():
                used.setdefault(node, {}).setdefault(name, Decimal(0))
                used[node][name] += parse_quantity(str(value))
    return used


def workers_per_node(nodes: Iterable[Any], pods: Iterable[Any], settings: objects.PodSettings
                     ) -> tuple[dict[str, int], dict[str, str]]:
    """({node: worker pods that fit}, {node: why none can go there}) for the nodes of the cluster."""
    need = pod_requests(settings)
    used = requested_by_pods(pods)
    fits, reasons = {}, {}
    for node in nodes:
        name = node.metadata.name
        why = blocked(node, settings)
        if why:
            reasons[name] = why
            continue
        allocatable = (node.status.allocatable if node.status else None) or {}
        free = {r: parse_quantity(str(allocatable.get(r, 0))) - used.get(name, {}).get(r, Decimal(0)) for r in need}
        fits[name] = min(max(0, int(free[r] // need[r])) for r in need)
    return fits, reasons
