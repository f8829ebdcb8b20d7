"""Kubernetes backend: one bare pod per rank, found by the others through a headless Service.

The official client's `CoreV1Api` and `NetworkingV1Api` come in ready-made (built from an Airflow connection by
`tf_multiworker.kubernetes_clients`), so this module never imports Airflow. Per group it creates the objects of
`kubernetes_objects` (Service, Secret, NetworkPolicy, then the pods, which are owned by the Service), follows each
pod's status with one list call per group and second, and streams each pod's log into the handle's `output`,
reconnecting without repeating lines. A pod stuck Pending writes its status and events into its output and its
`waiting_reason`, so they are in the group's failure message when `startup_timeout_s` ends it. Stopping the group deletes its objects; `release`
deletes whatever of a run is left, by label, and lists again to prove that nothing remains.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, ClassVar

import urllib3
from kubernetes.client import CoreV1Api, NetworkingV1Api, V1DeleteOptions, V1Pod
from kubernetes.client.rest import ApiException

from tf_multiworker.launcher import kubernetes_capacity as capacity
from tf_multiworker.launcher import kubernetes_objects as objects
from tf_multiworker.launcher.backend import RELEASE_GRACE_S, Backend, Capacity, WorkerHandle
from tf_multiworker.launcher.errors import LaunchError
from tf_multiworker.launcher.process import ORPHAN_GRACE_S
from tf_multiworker.launcher.spec import GroupSpec, Placement, WorkerSpec

log = logging.getLogger(__name__)

# Variables of the launcher's environment that every worker needs to agree with it (trainer/config.py reads the
# access policy from them); a pod does not inherit the Airflow worker's environment.
FORWARDED_PREFIXES = ("GPT_FINETUNE_",)
# Status codes worth retrying: the API server overloaded or restarting, or a rate limit.
RETRIED_STATUSES = {429, 500, 502, 503, 504}
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)
FORBIDDEN_HINT = (" (the identity of kubernetes_conn_id needs the Role of docs/backends.md's 'Cluster prerequisites' "
                  "in this namespace, and the namespace's ResourceQuota room for the pods)")
EVENTS_EVERY_S = 5.0
LOG_RECONNECT_PAUSE_S = 0.5
MAX_READS_AFTER_END = 5


class KubernetesApiError(LaunchError):
    """The API server refused a call (RBAC, quota, validation) or stayed unreachable through the retries."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def api_reason(exc: ApiException) -> str:
    """`403 Forbidden: pods is forbidden: User ... cannot create ...`: the status and the API's own message."""
    message = ""
    try:
        body = json.loads(exc.body or "{}")
        reason = body.get("reason") if body.get("reason") != exc.reason else None  # "Forbidden" once, not twice
        message = ": ".join(p for p in (reason, body.get("message")) if p)
    except (TypeError, ValueError):
        message = (exc.body or "").strip()[:300]
    return f"{exc.status} {exc.reason or ''}".strip() + (f": {message}" if message else "")


@dataclass(frozen=True)
class KubernetesSettings:
    """Everything about the cluster but the clients: checked in `trainer.config.RunConfig` first."""

    namespace: str
    pod: objects.PodSettings
    keep_failed_pods: bool = False
    python: str = "python3"  # the image's interpreter (docker/trainer.Dockerfile)
    status_interval_s: float = 1.0
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    retries: int = 4  # after the first try, with backoff 0.5, 1, 2, 4 s
    conn_id: str = ""  # for messages and records only

    def __post_init__(self) -> None:
        if not objects.is_dns_label(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} is not a DNS label (lowercase letters, digits and '-', "
                             "at most 63 characters)")


class _Api:
    """The client calls with explicit timeouts, retries of transient errors with backoff, and API errors turned
    into `KubernetesApiError` naming what was being done."""

    def __init__(self, core: CoreV1Api, networking: NetworkingV1Api, settings: KubernetesSettings,
                 sleep: Callable[[float], None]) -> None:
        self.core, self.networking, self.settings, self.sleep = core, networking, settings, sleep
        self.timeout = (settings.connect_timeout_s, settings.request_timeout_s)

    def call(self, what: str, method: Callable[..., Any], *args: Any, missing_ok: bool = False,
             retries: int | None = None, **kwargs: Any) -> Any:
        retries = self.settings.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                return method(*args, _request_timeout=self.timeout, **kwargs)
            except ApiException as exc:
                if exc.status == 404 and missing_ok:
                    return None
                if exc.status not in RETRIED_STATUSES or attempt == retries:
                    hint = FORBIDDEN_HINT if exc.status == 403 else ""
                    raise KubernetesApiError(f"{what} failed: {api_reason(exc)}{hint}", exc.status) from exc
                reason = api_reason(exc)
            except TRANSPORT_ERRORS as exc:
                if attempt == retries:
                    raise KubernetesApiError(f"{what} failed: the API server did not answer ({exc})") from exc
                reason = str(exc)
            delay = 0.5 * 2 ** attempt
            log.warning("%s: %s; retrying in %g s (%d of %d)", what, reason, delay, attempt + 1, retries)
            self.sleep(delay)
        raise AssertionError("unreachable")

    def delete(self, kind: str, name: str, retries: int | None = None, **options: Any) -> bool:
        """Delete one object; False when it was already gone (404)."""
        ns = self.settings.namespace
        method = {"pod": self.core.delete_namespaced_pod, "service": self.core.delete_namespaced_service,
                  "secret": self.core.delete_namespaced_secret,
                  "networkpolicy": self.networking.delete_namespaced_network_policy}[kind]
        body = V1DeleteOptions(**options) if options else None
        return self.call(f"deleting {kind} {ns}/{name}", method, name, ns, body=body, missing_ok=True,
                         retries=retries) is not None

    def cluster(self) -> tuple[list[Any], list[Any]]:
        """Every node, and every pod of every namespace (what is already requested on each node)."""
        nodes = self.call("listing the cluster's nodes", self.core.list_node, retries=0).items
        pods = self.call("listing the pods of every namespace", self.core.list_pod_for_all_namespaces, retries=0)
        return nodes, pods.items

    def list(self, kind: str, selector: str) -> list[Any]:
        ns = self.settings.namespace
        method = {"pod": self.core.list_namespaced_pod, "service": self.core.list_namespaced_service,
                  "secret": self.core.list_namespaced_secret,
                  "networkpolicy": self.networking.list_namespaced_network_policy}[kind]
        return self.call(f"listing {kind}s {selector} in {ns}", method, ns, label_selector=selector).items


def _exit_code(pod: V1Pod) -> int | None:
    """The container's exit status once it terminated; a signal as its negative number (runtimes report 128+n)."""
    for status in pod.status.container_statuses or []:
        terminated = status.state and status.state.terminated
        if terminated:
            code = terminated.exit_code
            if terminated.signal:
                return -terminated.signal
            return -(code - 128) if 128 < code <= 128 + 64 else code
    if pod.status.phase == "Failed":  # e.g. evicted before the container ran
        return 1
    return None


def _termination(pod: V1Pod) -> str:
    for status in pod.status.container_statuses or []:
        terminated = status.state and status.state.terminated
        if terminated:
            return f"exit code {terminated.exit_code} ({terminated.reason or 'no reason given'})"
    return pod.status.reason or pod.status.message or "no container status"


def _pending_reason(pod: V1Pod) -> str:
    for status in pod.status.container_statuses or []:
        waiting = status.state and status.state.waiting
        if waiting and waiting.reason:
            return f"{waiting.reason}: {waiting.message}" if waiting.message else waiting.reason
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return f"{condition.reason}: {condition.message}" if condition.message else condition.reason
    return "Pending"


def _time_key(stamp: bytes) -> tuple[str, str]:
    """An RFC3339(Nano) timestamp as a sortable key (the kubelet trims trailing zeros of the fraction)."""
    whole, _, fraction = stamp.decode("ascii", "replace").rstrip("Z").partition(".")
    return whole, fraction.ljust(9, "0")


class _LogCursor:
    """Where a pod's log was read up to, so that a reopened stream repeats no line.

    A reopened stream asks for `since_seconds` reaching back past the last line received (measured on this
    machine's monotonic clock, so the node's clock does not matter), then skips every line older than that one
    and as many lines with its exact timestamp as were already delivered."""

    def __init__(self) -> None:
        self.last: tuple[str, str] | None = None
        self.at_last = 0  # lines delivered with exactly the `last` timestamp
        self.received_at = 0.0
        self._skip = 0

    def since_seconds(self) -> int | None:
        return None if self.last is None else max(1, math.ceil(time.monotonic() - self.received_at) + 2)

    def reopen(self) -> None:
        self._skip = self.at_last

    def is_new(self, stamp: bytes) -> bool:
        key = _time_key(stamp)
        if self.last is not None and key < self.last:
            return False
        if key == self.last and self._skip > 0:
            self._skip -= 1
            return False
        self.at_last = self.at_last + 1 if key == self.last else 1
        self.last, self.received_at = key, time.monotonic()
        return True


@dataclass
class _GroupState:
    """One launched group: its names, its Service's uid and the handles the status loop updates."""

    spec: GroupSpec
    names: objects.GroupNames
    service_uid: str
    handles: dict[str, KubernetesWorkerHandle] = field(default_factory=dict)
    torn_down: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    watcher: threading.Thread | None = None


class KubernetesWorkerHandle(WorkerHandle):
    """One pod. `poll`/`gone` read the group's status loop; `output` is a pipe fed by the log follower."""

    def __init__(self, backend: KubernetesBackend, group: _GroupState, rank: int, host: str) -> None:
        self.backend = backend
        self.group = group
        self.rank = rank
        self.host = host
        self.pid = None
        self.pod = group.names.pod(rank)
        self.node: str | None = None
        self.exit_code: int | None = None
        self.started = threading.Event()  # the container ran (its log can be read)
        self.deleted = threading.Event()  # the pod object is gone
        self.pending_reason = ""
        self.termination = ""  # how a failed pod ended, written after its last log line
        self._seen = False  # the status loop has listed the pod at least once
        self._stopping = False  # this launcher deletes the pod: its disappearance is expected
        self._events_seen: set[str] = set()
        self._events_at = 0.0
        read_fd, self._write_fd = os.pipe()
        self._output = os.fdopen(read_fd, "rb")
        self._write_lock = threading.Lock()
        self._follower = threading.Thread(target=self._follow_log, daemon=True, name=f"log-{self.pod}")
        self._follower.start()

    # -- WorkerHandle ----------------------------------------------------------------------------------------

    @property
    def output(self) -> IO[bytes]:
        return self._output

    def poll(self) -> int | None:
        if self.exit_code is None and self.deleted.is_set():
            return -signal.SIGKILL  # deleted from outside before its end was seen
        return self.exit_code

    def terminate(self) -> None:
        self._stopping = True
        self.backend._stop_pod(self, grace_s=self.group.spec.grace_period_s)

    def kill(self) -> None:
        self._stopping = True
        self.backend._stop_pod(self, grace_s=0)

    def gone(self) -> bool:
        return self.deleted.is_set() or self.exit_code is not None

    def waiting_reason(self) -> str:
        if self.started.is_set() or self.deleted.is_set() or not self.pending_reason:
            return ""
        events = "; ".join(sorted(self._events_seen))
        return f"pod {self.pod} is Pending: {self.pending_reason}" + (f" (events: {events})" if events else "")

    def record(self) -> dict:
        return {"namespace": self.backend.settings.namespace, "pod": self.pod, "node": self.node}

    def label(self) -> str:
        return f"rank {self.rank} pod {self.pod}"

    # -- fed by the backend's status loop -------------------------------------------------------------------

    def _update(self, pod: V1Pod | None) -> None:
        if pod is None:
            if self.started.is_set() or self.exit_code is not None or self._seen:
                if self.exit_code is None and not self._stopping and not self.deleted.is_set():
                    self.termination = (f"[kubernetes] pod {self.pod} was deleted before its container ended "
                                        "(kubectl delete, an eviction or a lost node)")
                self.deleted.set()
            return
        self._seen = True
        self.node = pod.spec.node_name or self.node
        phase = pod.status.phase if pod.status else "Pending"
        if phase in ("Running", "Succeeded", "Failed"):
            self.started.set()
        if self.exit_code is None:
            self.exit_code = _exit_code(pod)
            if self.exit_code not in (None, 0):
                where = f" on node {self.node}" if self.node else ""
                self.termination = f"[kubernetes] pod {self.pod}{where} ended {phase}: {_termination(pod)}"
        if phase == "Pending":
            reason = _pending_reason(pod)
            if reason != self.pending_reason:
                self.pending_reason = reason
                self._emit(f"[kubernetes] pod {self.pod} is Pending: {reason}")
            if time.monotonic() - self._events_at >= EVENTS_EVERY_S:
                self._events_at = time.monotonic()
                for line in self.backend._events(self.pod):
                    if line not in self._events_seen:
                        self._events_seen.add(line)
                        self._emit(f"[kubernetes] event of pod {self.pod}: {line}")

    def _emit(self, line: str) -> None:
        self._write(line.encode() + b"\n")

    def _write(self, data: bytes) -> None:
        with self._write_lock:
            if self._write_fd >= 0:
                try:
                    os.write(self._write_fd, data)
                except OSError:
                    pass  # the reader closed its end: nobody listens any more

    def _close_output(self) -> None:
        with self._write_lock:
            if self._write_fd >= 0:
                os.close(self._write_fd)
                self._write_fd = -1

    # -- the log follower -----------------------------------------------------------------------------------

    def _follow_log(self) -> None:
        """Copy the pod's log into the pipe until the container ended and one stream opened after its end was
        read to the end (a stream dropped near the end would miss the last lines, which explain a failure)."""
        try:
            while not (self.started.is_set() or self.deleted.is_set() or self.group.stop.is_set()):
                self.started.wait(0.2)
            cursor = _LogCursor()
            reads_after_end = 0
            while self.started.is_set() and not self.group.stop.is_set():
                ended = self.exit_code is not None or self.deleted.is_set()
                complete = False
                try:
                    complete = self._read_log(cursor)
                except ApiException as exc:
                    if exc.status == 404:
                        return
                    log.debug("log of pod %s: %s", self.pod, api_reason(exc))
                except TRANSPORT_ERRORS as exc:
                    log.info("log stream of pod %s dropped (%s): reconnecting", self.pod, exc)
                if ended:
                    reads_after_end += 1
                    if complete or reads_after_end >= MAX_READS_AFTER_END:
                        return
                    continue
                time.sleep(LOG_RECONNECT_PAUSE_S)
        finally:
            if self.termination:
                self._emit(self.termination)
            self._close_output()

    def _read_log(self, cursor: _LogCursor) -> bool:
        """One follow stream, with timestamps, from where `cursor` says the last one stopped."""
        response = self.backend.api.core.read_namespaced_pod_log(
            self.pod, self.backend.settings.namespace, container=objects.CONTAINER_NAME, follow=True,
            timestamps=True, since_seconds=cursor.since_seconds(), _preload_content=False,
            # The provider's client would otherwise put its default read timeout on a quiet stream.
            _request_timeout=(self.backend.settings.connect_timeout_s, None))
        cursor.reopen()
        partial = b""
        try:
            for chunk in response.stream(64 * 1024, decode_content=False):
                *lines, partial = (partial + chunk).split(b"\n")
                for raw in lines:
                    self._log_line(cursor, raw)
            if partial:  # the last line of an ended container, without a newline
                self._log_line(cursor, partial)
            return True
        finally:
            response.release_conn()

    def _log_line(self, cursor: _LogCursor, raw: bytes) -> None:
        stamp, _, text = raw.partition(b" ")
        if cursor.is_new(stamp):
            self._write(text + b"\n")



class KubernetesBackend(Backend):
    name: ClassVar[str] = "kubernetes"

    def __init__(self, core: CoreV1Api, networking: NetworkingV1Api, settings: KubernetesSettings, *,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.settings = settings
        self.api = _Api(core, networking, settings, sleep)
        self._groups: dict[str, _GroupState] = {}
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
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
        pod_settings = dataclasses.replace(self.settings.pod, grace_period_s=group.grace_period_s)
        body = objects.pod(names, worker.rank, pod_settings, command, {**forwarded, **env},
                           with_secret=bool(group.secret_env),
                           owner=objects.owner_reference(names.service, state.service_uid))
        try:
            self._create_pod(body, names, worker.rank)
        except BaseException:
            self._teardown(state)
            raise
        handle = KubernetesWorkerHandle(self, state, worker.rank, worker.host)
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
        kept = []
        for handle in list(state.handles.values()):
            if self.settings.keep_failed_pods and handle.exit_code not in (None, 0):
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

    def end_earlier_attempts(self, group: GroupSpec) -> list[dict]:
        """The group's pods and objects that an earlier attempt left (its launcher died before deleting them),
        found by the group's labels, deleted as release deletes them."""
        names = objects.GroupNames(group.run_key, group.name, self.settings.namespace)
        return [self._delete_labelled(names.selector, grace_s=min(group.grace_period_s, ORPHAN_GRACE_S))]

    def release(self, run_key: str, records: list[dict], grace_s: float = RELEASE_GRACE_S) -> dict:
        """Delete every object labelled with the run (the records are not needed: the label also finds what no
        record names), pods with up to `grace_s` of grace and then at once, and list again to prove nothing is
        left."""
        host = self._delete_labelled(objects.run_selector(run_key), grace_s=grace_s)
        return {"backend": self.name, "hosts": [host], "clean": not host["survivors"]}

    def _delete_labelled(self, selector: str, grace_s: float) -> dict:
        """Delete every object matching `selector` (pods with `grace_s`, capped by the pods' own grace period, then
        at once) and list again; failed pods stay when `keep_failed_pods`. Returns what was found and what is left."""
        ns = self.settings.namespace
        pods = self.api.list("pod", selector)
        found = {"pod": [p.metadata.name for p in pods],
                 **{kind: [o.metadata.name for o in self.api.list(kind, selector)]
                    for kind in ("service", "secret", "networkpolicy")}}
        kept = [p.metadata.name for p in pods if self.settings.keep_failed_pods and p.status.phase == "Failed"]
        orphan = {"propagation_policy": "Orphan"} if kept else {"propagation_policy": "Background"}
        for name in found["service"]:
            self.api.delete("service", name, **orphan)
        for kind in ("secret", "networkpolicy"):
            for name in found[kind]:
                self.api.delete(kind, name)
        doomed = [p.metadata.name for p in pods if p.metadata.name not in kept]
        grace = math.ceil(min(self.settings.pod.grace_period_s, grace_s))
        for name in doomed:
            self.api.delete("pod", name, grace_period_seconds=grace)
        remaining = self._wait_gone(selector, kept, grace + 5)
        killed = list(remaining.get("pod", []))
        for name in killed:
            self.api.delete("pod", name, grace_period_seconds=0)
        if killed:
            remaining = self._wait_gone(selector, kept, 10)
        survivors = [f"{kind}/{name}" for kind, names in remaining.items() for name in names]
        return {
            "host": f"namespace {ns}" + (f" (connection {self.settings.conn_id})" if self.settings.conn_id else ""),
            "selector": selector,
            "found": [f"{kind}/{name}" for kind, names in found.items() for name in names],
            "terminated": [f"pod/{name}" for name in doomed if name not in killed],
            "killed": [f"pod/{name}" for name in killed],
            "kept": [f"pod/{name}" for name in kept],
            "survivors": survivors,
        }

    def close(self) -> None:
        with self._lock:
            groups = list(self._groups.values())
        for state in groups:
            state.stop.set()

    # -- internals -------------------------------------------------------------------------------------------

    def _group(self, group: GroupSpec) -> _GroupState:
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
        state = _GroupState(group, names, service.metadata.uid)
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
        state.watcher = threading.Thread(target=self._watch, args=(state,), daemon=True, name=f"watch-{group.name}")
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

    def _watch(self, state: _GroupState) -> None:
        """One list call per interval for the whole group updates every handle (never a call per poll)."""
        while not state.stop.is_set():
            try:
                pods = {p.metadata.name: p for p in self.api.list("pod", state.names.selector)}
            except KubernetesApiError as exc:
                log.warning("group %s: pod status unavailable: %s", state.spec.name, exc)
            else:
                for name, handle in list(state.handles.items()):
                    handle._update(pods.get(name))
            state.stop.wait(self.settings.status_interval_s)
        for handle in list(state.handles.values()):
            handle.started.set()  # a follower still waiting for a Pending pod ends now

    def _events(self, pod: str) -> list[str]:
        try:
            events = self.api.call(f"listing events of pod {pod}", self.api.core.list_namespaced_event,
                                   self.settings.namespace, field_selector=f"involvedObject.name={pod}",
                                   retries=0).items
        except KubernetesApiError as exc:
            return [f"(events unavailable: {exc})"]
        return [f"{e.type or ''} {e.reason}: {e.message}".strip() for e in events]

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

    def _teardown(self, state: _GroupState) -> None:
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

    def _wait_gone(self, selector: str, kept: list[str], timeout_s: float) -> dict[str, list[str]]:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = {kind: names for kind in ("pod", "service", "secret", "networkpolicy")
                         if (names := [o.metadata.name for o in self.api.list(kind, selector)
                                       if o.metadata.name not in kept])}
            if not remaining or time.monotonic() > deadline:
                return remaining
            time.sleep(0.2)
