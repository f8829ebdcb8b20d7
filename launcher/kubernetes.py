"""Kubernetes backend: one bare pod per rank, found by the others through a headless Service.

The official client's `CoreV1Api` and `NetworkingV1Api` come in ready-made (built from an Airflow connection by
`tf_multiworker.kubernetes_clients`), so this module never imports Airflow. Per group it creates the objects of
`kubernetes_objects` (Service, Secret, NetworkPolicy, then the pods, which are owned by the Service) through
`kubernetes_api`; `kubernetes_pods` follows each pod's status and log. Stopping the group deletes its objects;
`release` deletes whatever of a run is left, by label, and lists again until the pods have terminated
(`kubernetes_release`: never a forced deletion, and the record says what was checked).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kubernetes.client import CoreV1Api, NetworkingV1Api, V1Pod

from core.kubernetes_names import is_dns_label
from launcher import kubernetes_capacity as capacity
from launcher import kubernetes_objects as objects
from launcher import kubernetes_release
from launcher.backend import RELEASE_GRACE_S, Backend, Capacity, HostRelease, ReleaseResult, WorkerHandle
from launcher.errors import LaunchError
from launcher.gpus import GPU_RELEASE_WAIT_S
from launcher.kubernetes_api import KubernetesApi, KubernetesApiError
from launcher.kubernetes_pods import KubernetesWorkerHandle, LaunchedGroup, follow_status
from launcher.process import ORPHAN_GRACE_S
from launcher.spec import GroupSpec, Placement, WorkerOutcome, WorkerSpec
from launcher.state_record import StateRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KubernetesSettings:
    """Everything about the cluster but the clients: checked in `core.config.RunConfig` first."""

    namespace: str
    pod: objects.PodSettings
    keep_failed_pods: bool = False
    python: str = "python3"  # the image's interpreter (docker/trainer.Dockerfile)
    status_interval_s: float = 1.0
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    retries: int = 4  # after the first try, with backoff 0.5, 1, 2, 4 s
    termination_margin_s: float = 10.0  # release waits this long past a pod's grace period for its kubelet
    conn_id: str = ""  # for messages and records only

    def __post_init__(self) -> None:
        if not is_dns_label(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} is not a DNS label (lowercase letters, digits and '-', "
                             "at most 63 characters)")


class KubernetesBackend(Backend):
    name: ClassVar[str] = "kubernetes"

    def __init__(self, core: CoreV1Api, networking: NetworkingV1Api, settings: KubernetesSettings, *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings = settings
        self.api = KubernetesApi(core, networking, settings.namespace,
                                 timeout=(settings.connect_timeout_s, settings.request_timeout_s),
                                 retries=settings.retries, sleep=sleep)
        self._groups: dict[str, LaunchedGroup] = {}
        self._ended: dict[str, dict[str, str | None]] = {}  # group -> pod -> how its end was seen (end_group)
        self._lock = threading.Lock()

    # -- Backend ---------------------------------------------------------------------------------------------

    def place(self, group: GroupSpec) -> list[Placement]:
        gpus = self.settings.pod.gpus
        if gpus and not group.use_gpu:
            raise LaunchError(f"gpus_per_worker={gpus} needs use_gpu=true (group {group.name})")
        if group.use_gpu and not gpus:
            raise LaunchError(f"use_gpu is on but the pods request no GPU: set gpus_per_worker >= 1 "
                              f"(group {group.name})")
        names = objects.GroupNames(group.run_key, group.name, self.settings.namespace)
        where = {"namespace": self.settings.namespace, **({"conn_id": self.settings.conn_id}
                                                          if self.settings.conn_id else {})}
        # devices None: the device plugin gives each pod its GPUs, and CUDA_VISIBLE_DEVICES must stay unset.
        return [Placement(names.address(rank), objects.WORKER_PORT, None if gpus else (),
                          {**where, "pod": names.pod(rank)})
                for rank in range(group.num_workers)]

    def capacity(self, group: GroupSpec) -> Capacity:
        """Worker pods that fit on the cluster's nodes now (kubernetes_capacity.py); all of them when a pod requests
        nothing, or when the nodes cannot be listed (RBAC): then the scheduler decides, and pods it cannot place
        stay Pending until `startup_timeout_s` names them."""
        if not capacity.pod_requests(self.settings.pod):
            return Capacity(group.num_workers)
        try:
            nodes, pods = self.api.cluster()
        except KubernetesApiError as error:
            log.warning("cannot tell how many pods the cluster can place (%s): launching all %d", error,
                        group.num_workers)
            return Capacity(group.num_workers)
        fits, blocked = capacity.workers_per_node(nodes, pods, self.settings.pod)
        workers = sum(fits.values())
        if workers >= group.num_workers:
            return Capacity(workers)
        per_node = [f"{node}: {count}" for node, count in sorted(fits.items())]
        per_node += [f"{node}: none ({why})" for node, why in sorted(blocked.items())]
        reason = (f"the cluster's nodes fit {workers} worker pod(s) of {self._requests_text()} "
                  f"({'; '.join(per_node) or 'no nodes'})")
        return Capacity(workers, (reason,))

    def _requests_text(self) -> str:
        pod = self.settings.pod
        return ", ".join(part for part in (f"{pod.gpus} GPU" if pod.gpus else "", f"{pod.cpu} CPU" if pod.cpu else "",
                                           f"{pod.memory} memory" if pod.memory else "") if part)

    def command(self, group: GroupSpec) -> list[str]:
        return [self.settings.python, "-u", "-m", group.entrypoint, *group.args]

    def start(self, group: GroupSpec, worker: WorkerSpec, command: list[str], env: Mapping[str, str]) -> WorkerHandle:
        state = self._group(group)
        names = state.names
        leaked = sorted(set(env) & set(group.secret_env))
        if leaked:
            raise LaunchError(f"variables {leaked} would be literal values in the pod spec: secrets go only "
                              "through the group's Secret")
        pod_settings = dataclasses.replace(self.settings.pod, grace_period_s=group.grace_period_s)
        body = objects.pod(names, worker.rank, pod_settings, command, env,
                           with_secret=bool(group.secret_env),
                           owner=objects.owner_reference(names.service, state.service_uid))
        try:
            self._create_pod(body, names, worker.rank)
        except BaseException:
            self._teardown(state)
            raise
        handle = KubernetesWorkerHandle(self.api, state, worker.rank, worker.host, self._stop_pod)
        with self._lock:
            state.handles[handle.pod] = handle
        log.info("rank %d: pod %s/%s created (image %s)", worker.rank, self.settings.namespace, handle.pod,
                 self.settings.pod.image)
        return handle

    def end_group(self, group: GroupSpec) -> None:
        with self._lock:
            state = self._groups.pop(group.name, None)
        if state is None:
            return
        state.stop.set()
        self._teardown(state)
        self._ended[group.name] = {handle.pod: handle.end_evidence() for handle in state.handles.values()}
        kept = []
        for handle in list(state.handles.values()):
            failed = handle.exit_code not in (None, 0) and not handle.stopped_by_launcher
            if self.settings.keep_failed_pods and failed:
                kept.append(handle.pod)
                continue
            try:
                self.api.delete("pod", handle.pod, grace_period_seconds=0)
            except KubernetesApiError as exc:  # the group's own outcome matters more; release retries by label
                log.warning("group %s: %s", group.name, exc)
        if kept:
            log.warning("keep_failed_pods: kept failed pod(s) %s in namespace %s for debugging (`kubectl logs`, "
                        "`kubectl describe`); delete them with `kubectl delete pod -l %s`", kept,
                        self.settings.namespace, state.names.selector)
        if state.watcher:
            state.watcher.join(self.settings.status_interval_s + 5)

    def check_slots_free(self, group: GroupSpec, workers: Sequence[WorkerOutcome]) -> dict[str, Any]:
        """The group's pods ended (seen from their kubelets) and none of them listed still running: what the pods
        held (their GPUs) is free (kubernetes_release.check_group_ended, bounded like release's GPU check)."""
        names = objects.GroupNames(group.run_key, group.name, self.settings.namespace)
        evidence = self._ended.pop(group.name, {})
        check = kubernetes_release.check_group_ended(self.api, names.selector, evidence, GPU_RELEASE_WAIT_S)
        return {**check, "slots": "gpu" if group.use_gpu else "cpu"}

    def end_earlier_attempts(self, group: GroupSpec) -> list[HostRelease]:
        """The group's pods and objects that an earlier attempt left (its launcher died before deleting them),
        found by the group's labels, deleted as release deletes them."""
        names = objects.GroupNames(group.run_key, group.name, self.settings.namespace)
        return [self._delete_labelled(names.selector, grace_s=min(group.grace_period_s, ORPHAN_GRACE_S))]

    def release(self, run_key: str, records: Sequence[StateRecord], grace_s: float = RELEASE_GRACE_S) -> ReleaseResult:
        """Delete every object labelled with the run (the records are not needed: the label also finds what no
        record names), pods with up to `grace_s` of grace, and list again until their kubelets have ended them:
        a pod still listed after its grace period is a survivor, never force-deleted."""
        host = self._delete_labelled(objects.run_selector(run_key), grace_s=grace_s)
        return ReleaseResult(self.name, (host,), clean=not host.survivors)

    def _delete_labelled(self, selector: str, grace_s: float) -> HostRelease:
        """Delete every object matching `selector`, pods with `grace_s` at most (their own grace period when
        shorter, never 0), and list again until they are gone (kubernetes_release.py); failed pods stay when
        `keep_failed_pods`. Returns what was found, what is left and what was checked."""
        host = kubernetes_release.delete_labelled(self.api, selector, grace_s,
                                                  keep_failed=self.settings.keep_failed_pods,
                                                  margin_s=self.settings.termination_margin_s)
        where = host["host"] + (f" (connection {self.settings.conn_id})" if self.settings.conn_id else "")
        return HostRelease.of(where, host)

    def close(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
        for state in groups:
            state.stop.set()

    # -- internals -------------------------------------------------------------------------------------------

    def _group(self, group: GroupSpec) -> LaunchedGroup:
        """The group's Service, Secret and NetworkPolicy, created once per group (by its first rank)."""
        with self._lock:
            state = self._groups.get(group.name)
            if state is not None and not state.torn_down:
                return state
            if state is not None:
                state.stop.set()  # a relaunch: the earlier attempt's pods are gone by now
        names = objects.GroupNames(group.run_key, group.name, self.settings.namespace)
        ns = self.settings.namespace
        service = self._create_or_adopt_service(names)
        state = LaunchedGroup(group, names, service.metadata.uid)
        owner = objects.owner_reference(names.service, state.service_uid)
        try:
            if group.secret_env:
                self.api.delete("secret", names.secret)  # a stale one from an earlier try of the same task
                self.api.call(f"creating secret {ns}/{names.secret}", self.api.core.create_namespaced_secret, ns,
                              objects.secret(names, group.secret_env, owner))
            self.api.delete("networkpolicy", names.network_policy)
            self.api.call(f"creating networkpolicy {ns}/{names.network_policy}",
                          self.api.networking.create_namespaced_network_policy, ns,
                          objects.network_policy(names, owner))
        except BaseException:
            self._teardown(state)
            raise
        state.watcher = threading.Thread(target=follow_status, args=(state, self.api, self.settings.status_interval_s),
                                         daemon=True, name=f"watch-{group.name}")
        with self._lock:
            self._groups[group.name] = state
        state.watcher.start()
        log.info("group %s: Service %s/%s (headless), NetworkPolicy %s%s; pods labelled %s", group.name, ns,
                 names.service, names.network_policy, f", Secret {names.secret}" if group.secret_env else "",
                 names.selector)
        return state

    def _create_or_adopt_service(self, names: objects.GroupNames) -> Any:
        ns = self.settings.namespace
        what = f"creating service {ns}/{names.service}"
        try:
            return self.api.call(what, self.api.core.create_namespaced_service, ns, objects.service(names))
        except KubernetesApiError as exc:
            if exc.status != 409:
                raise
        existing = self.api.call(f"reading service {ns}/{names.service}", self.api.core.read_namespaced_service,
                                 names.service, ns)
        if (existing.metadata.labels or {}) != names.selector_labels:
            raise KubernetesApiError(f"{what}: a Service of that name exists with labels "
                                     f"{existing.metadata.labels} that are not this group's ({names.selector}); "
                                     "delete it or use another namespace", 409)
        return existing  # an earlier try of the same task left it: same run, same group

    def _create_pod(self, body: V1Pod, names: objects.GroupNames, rank: int) -> None:
        ns = self.settings.namespace
        what = f"creating pod {ns}/{body.metadata.name}"
        try:
            self.api.call(what, self.api.core.create_namespaced_pod, ns, body)
            return
        except KubernetesApiError as exc:
            if exc.status != 409:
                raise
        existing = self.api.call(f"reading pod {ns}/{body.metadata.name}", self.api.core.read_namespaced_pod,
                                 body.metadata.name, ns, missing_ok=True)
        if existing is not None and (existing.metadata.labels or {}) != names.pod_labels(rank):
            raise KubernetesApiError(f"{what}: a pod of that name exists with labels {existing.metadata.labels} "
                                     f"that are not this rank's; delete it or use another namespace", 409)
        # The same rank of an earlier try (or of this create, answered 5xx after it took effect): replace it.
        self.api.delete("pod", body.metadata.name, grace_period_seconds=0)
        deadline = time.monotonic() + 30
        while self.api.call(f"reading pod {ns}/{body.metadata.name}", self.api.core.read_namespaced_pod,
                            body.metadata.name, ns, missing_ok=True) is not None:
            if time.monotonic() > deadline:
                raise KubernetesApiError(f"{what}: an earlier pod of that name did not go away within 30 s", 409)
            time.sleep(0.2)
        self.api.call(what, self.api.core.create_namespaced_pod, ns, body)

    def _stop_pod(self, handle: KubernetesWorkerHandle, grace_s: float) -> None:
        """Delete the pod (the kubelet sends SIGTERM, waits `grace_s`, then SIGKILL) and, the first time any rank
        of the group is stopped, the group's other objects: stopping one rank ends the group."""
        self._teardown(handle.group)
        if handle.deleted.is_set():
            return
        try:
            # One retry only: this may run in Airflow's on_kill, which has 5 s in all.
            self.api.delete("pod", handle.pod, retries=1, grace_period_seconds=math.ceil(grace_s))
        except KubernetesApiError as exc:
            log.warning("rank %d: %s", handle.rank, exc)

    def _teardown(self, state: LaunchedGroup) -> None:
        """Delete the group's Service, Secret and NetworkPolicy (pods are deleted by their handles, and the
        Service's deletion cascades to any it owns unless failed pods are kept)."""
        with self._lock:
            if state.torn_down:
                return
            state.torn_down = True
        names = state.names
        policy = "Orphan" if self.settings.keep_failed_pods else "Background"
        for kind, name, options in (("service", names.service, {"propagation_policy": policy}),
                                    ("secret", names.secret, {}), ("networkpolicy", names.network_policy, {})):
            try:
                self.api.delete(kind, name, retries=1, **options)  # may run in on_kill: 5 s in all
            except KubernetesApiError as exc:
                log.warning("group %s: %s", state.spec.name, exc)
