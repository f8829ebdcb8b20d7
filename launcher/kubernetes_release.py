"""Deleting what carries a label, and proving it gone: the kubernetes backend's release and its sweep of earlier
attempts.

A pod is deleted with a grace period: its kubelet sends SIGTERM, waits the grace period, sends SIGKILL, and only
once it has reported the containers ended does the API server drop the pod object. So a pod counts as gone only
when a list by label no longer shows it. A forced deletion (grace 0) drops the object at once, whatever the node
still runs, so it proves nothing: this module never asks for one. A pod still listed when its grace period and a
margin for its kubelet (`termination_margin_s`) have passed is reported as a survivor, with its node, phase and
what to do; a retried release checks again. The host entry says what was checked (`checked`) and, per pod, the
grace asked for and when the pod was gone (`pods`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from launcher.kubernetes_api import KubernetesApi

POLL_S = 0.2
KINDS = ("pod", "service", "secret", "networkpolicy")


@dataclass
class PodEnd:
    """One pod release deleted: the grace it asked for, and when (seconds after the delete) no list showed it."""

    pod: str
    node: str | None
    grace_s: int
    phase: str | None
    gone_after_s: float | None = None


def delete_grace_s(pod: Any, grace_s: float) -> int:
    """The grace to delete `pod` with: its own `terminationGracePeriodSeconds`, at most `grace_s`, never 0."""
    own = getattr(pod.spec, "termination_grace_period_seconds", None) if pod.spec else None
    return max(1, math.ceil(grace_s if own is None else min(own, grace_s)))


def _phase(pod: Any) -> str | None:
    phase = pod.status.phase if pod.status else None
    return f"{phase} (terminating)" if pod.metadata.deletion_timestamp else phase


def delete_labelled(api: KubernetesApi, selector: str, grace_s: float, *, keep_failed: bool, margin_s: float,
                    clock: Callable[[], float] = time.monotonic,
                    sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Delete every object matching `selector` (pods gracefully, see the module doc; failed pods stay when
    `keep_failed`) and list again until none is left or the pods' grace and `margin_s` have passed. Returns the
    host entry of a release record."""
    pods = api.list("pod", selector)
    found = {"pod": [p.metadata.name for p in pods],
             **{kind: [o.metadata.name for o in api.list(kind, selector)] for kind in KINDS[1:]}}
    kept = [p.metadata.name for p in pods if keep_failed and p.status and p.status.phase == "Failed"]
    for name in found["service"]:
        api.delete("service", name, propagation_policy="Orphan" if kept else "Background")
    for kind in ("secret", "networkpolicy"):
        for name in found[kind]:
            api.delete(kind, name)
    ends = {p.metadata.name: PodEnd(p.metadata.name, p.spec.node_name if p.spec else None, delete_grace_s(p, grace_s),
                                    _phase(p)) for p in pods if p.metadata.name not in kept}
    started = clock()
    for end in ends.values():
        api.delete("pod", end.pod, grace_period_seconds=end.grace_s)
    wait_s = max((end.grace_s for end in ends.values()), default=0) + margin_s
    remaining = _wait_gone(api, selector, kept, ends, wait_s, lambda: clock() - started, sleep)
    survivors = [f"{kind}/{name}" for kind, names in remaining.items() for name in names]
    return {
        "host": f"namespace {api.namespace}",
        "selector": selector,
        "found": [f"{kind}/{name}" for kind, names in found.items() for name in names],
        "terminated": [f"pod/{end.pod}" for end in ends.values() if end.gone_after_s is not None],
        "killed": [],  # the kubelet's SIGKILL after the grace period is not seen from the API: no forced deletion
        "kept": [f"pod/{name}" for name in kept],
        "survivors": survivors,
        "pods": [asdict(end) for end in ends.values()],
        "checked": (f"listed pods, services, secrets and network policies labelled {selector} in namespace "
                    f"{api.namespace} every {POLL_S:g} s for up to {wait_s:g} s (the longest grace asked for, "
                    f"{wait_s - margin_s:g} s, plus {margin_s:g} s for the kubelet): a pod counts as gone only "
                    "once the API server no longer lists it, which after a graceful delete means its kubelet "
                    "reported its containers ended; no pod was force-deleted"),
        "problems": [_stuck(api.namespace, ends[name], wait_s) for name in remaining.get("pod", []) if name in ends],
    }


def _wait_gone(api: KubernetesApi, selector: str, kept: list[str], ends: dict[str, PodEnd], wait_s: float,
               elapsed: Callable[[], float], sleep: Callable[[float], None]) -> dict[str, list[str]]:
    """List until nothing but `kept` is left or `wait_s` has passed (`elapsed`: seconds since the deletes); notes
    when each pod stopped being listed."""
    while True:
        listed = {kind: [o for o in api.list(kind, selector) if o.metadata.name not in kept] for kind in KINDS}
        since_delete = elapsed()
        shown = {pod.metadata.name: pod for pod in listed["pod"]}
        for end in ends.values():
            if end.pod in shown:
                end.phase = _phase(shown[end.pod])
                end.node = (shown[end.pod].spec.node_name if shown[end.pod].spec else None) or end.node
            elif end.gone_after_s is None:
                end.gone_after_s = round(since_delete, 2)
        remaining = {kind: [o.metadata.name for o in objects] for kind, objects in listed.items() if objects}
        if not remaining or since_delete > wait_s:
            return remaining
        sleep(POLL_S)


TERMINAL_PHASES = ("Succeeded", "Failed")


def check_group_ended(api: KubernetesApi, selector: str, evidence: dict[str, str | None], wait_s: float, *,
                      clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Right after a group exited: its GPUs (its pods' resources) are free. `evidence` maps each of the group's pods
    to how its end was seen (`KubernetesWorkerHandle.end_evidence`). Free once every pod's end was seen and no pod
    matching `selector` is listed in a phase other than Succeeded or Failed (a kept failed pod holds nothing),
    listed again every POLL_S for up to `wait_s`. `free_after_s`: seconds to that proof (None: not proven)."""
    started = clock()
    while True:
        running = [f"{p.metadata.name} ({_phase(p)})" for p in api.list("pod", selector)
                   if (p.status.phase if p.status else None) not in TERMINAL_PHASES]
        if not running or clock() - started >= wait_s:
            break
        sleep(POLL_S)
    unseen = sorted(pod for pod, how in evidence.items() if how is None)
    free = bool(evidence) and not running and not unseen
    return {"checked": True, "free": free, "free_after_s": round(clock() - started, 3) if free
            else None, "pods": dict(sorted(evidence.items())), "still_listed": running,
            **({"note": f"no end seen of pod(s) {unseen} (deleted without a grace period)"} if unseen else {})}


def _stuck(namespace: str, end: PodEnd, wait_s: float) -> str:
    node = f" on node {end.node}" if end.node else ""
    return (f"pod {namespace}/{end.pod}{node} is still listed ({end.phase}) {wait_s:g} s after its delete with a "
            f"{end.grace_s} s grace period: its kubelet has not reported its containers ended (the node is down or "
            f"a container is stuck, e.g. in the GPU driver), so they may still run and hold GPUs. Check `kubectl "
            f"describe pod {end.pod} -n {namespace}` and the node; once the node is known to run nothing of it, "
            f"`kubectl delete pod {end.pod} -n {namespace} --grace-period=0 --force`; then clear the release task")
