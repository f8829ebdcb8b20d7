"""One worker pod as the launcher sees it: its status, read from the group's pod list, and its log, followed.

`follow_status` lists a group's pods once per interval and updates every `KubernetesWorkerHandle` of it (node,
phase, exit code, Pending reason and events); each handle's follower thread streams its pod's log into the handle's
`output`, reconnecting without repeating lines. A pod stuck Pending writes its status and events into its output
and its `waiting_reason`, so they are in the group's failure message when `startup_timeout_s` ends it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from kubernetes.client import V1Pod
from kubernetes.client.rest import ApiException

from launcher import kubernetes_objects as objects
from launcher.backend import WorkerHandle
from launcher.kubernetes_api import TRANSPORT_ERRORS, KubernetesApi, KubernetesApiError, api_reason
from launcher.process import exit_status_to_code
from launcher.spec import GroupSpec

log = logging.getLogger(__name__)

EVENTS_EVERY_S = 5.0
LOG_RECONNECT_PAUSE_S = 0.5
MAX_READS_AFTER_END = 5


def _exit_code(pod: V1Pod) -> int | None:
    """The container's exit status once it terminated; a signal as its negative number (runtimes report 128+n)."""
    for status in pod.status.container_statuses or []:
        terminated = status.state and status.state.terminated
        if terminated:
            code = terminated.exit_code
            if terminated.signal:
                return -terminated.signal
            return exit_status_to_code(code)
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
class LaunchedGroup:
    """One launched group: its names, its Service's uid and the handles the status loop updates."""

    spec: GroupSpec
    names: objects.GroupNames
    service_uid: str
    handles: dict[str, KubernetesWorkerHandle] = field(default_factory=dict)
    torn_down: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    watcher: threading.Thread | None = None


class KubernetesWorkerHandle(WorkerHandle):
    """One pod. `poll`/`gone` read the group's status loop; `output` is a pipe fed by the log follower.
    `stop_pod(handle, grace_s)` is the backend's: stopping one rank also tears down the group's other objects."""

    def __init__(self, api: KubernetesApi, group: LaunchedGroup, rank: int, host: str,
                 stop_pod: Callable[[KubernetesWorkerHandle, float], None]) -> None:
        self.api = api
        self.group = group
        self._stop_pod = stop_pod
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
        self._forced = False  # ... and without a grace period (kill): its disappearance proves nothing
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
        self._stop_pod(self, self.group.spec.grace_period_s)

    def kill(self) -> None:
        self._stopping = self._forced = True
        self._stop_pod(self, 0)

    @property
    def stopped_by_launcher(self) -> bool:
        """Whether this launcher asked the pod to stop: its exit (SIGTERM's 143, say) is then no failure of its own."""
        return self._stopping

    def gone(self) -> bool:
        return self.deleted.is_set() or self.exit_code is not None

    def end_evidence(self) -> str | None:
        """What shows that the pod's container ended: its kubelet reported it terminated (or the pod Failed), or the
        pod stopped being listed after this launcher deleted it with a grace period (the API server drops such a pod
        only once its kubelet reported the containers ended); None when nothing does (a forced deletion)."""
        if self.exit_code is not None:
            return "kubelet"
        if self.deleted.is_set() and self._stopping and not self._forced:
            return "graceful delete"
        return None

    def waiting_reason(self) -> str:
        if self.started.is_set() or self.deleted.is_set() or not self.pending_reason:
            return ""
        events = "; ".join(sorted(self._events_seen))
        return f"pod {self.pod} is Pending: {self.pending_reason}" + (f" (events: {events})" if events else "")

    def record(self) -> dict:
        return {"namespace": self.api.namespace, "pod": self.pod, "node": self.node}

    def label(self) -> str:
        return f"rank {self.rank} pod {self.pod}"

    # -- fed by follow_status -------------------------------------------------------------------------------

    def _update(self, pod: V1Pod | None) -> None:
        if pod is None:
            self._gone()
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
            self._report_pending(pod)

    def _gone(self) -> None:
        """The pod no longer exists: deleted by us, or from outside before its container ended."""
        if self.started.is_set() or self.exit_code is not None or self._seen:
            if self.exit_code is None and not self._stopping and not self.deleted.is_set():
                self.termination = (f"[kubernetes] pod {self.pod} was deleted before its container ended "
                                    "(kubectl delete, an eviction or a lost node)")
            self.deleted.set()

    def _report_pending(self, pod: V1Pod) -> None:
        """Why the pod waits, when that changes, and its new events every EVENTS_EVERY_S."""
        reason = _pending_reason(pod)
        if reason != self.pending_reason:
            self.pending_reason = reason
            self._emit(f"[kubernetes] pod {self.pod} is Pending: {reason}")
        if time.monotonic() - self._events_at >= EVENTS_EVERY_S:
            self._events_at = time.monotonic()
            for line in self._events():
                if line not in self._events_seen:
                    self._events_seen.add(line)
                    self._emit(f"[kubernetes] event of pod {self.pod}: {line}")

    def _events(self) -> list[str]:
        try:
            events = self.api.call(f"listing events of pod {self.pod}", self.api.core.list_namespaced_event,
                                   self.api.namespace, field_selector=f"involvedObject.name={self.pod}",
                                   retries=0).items
        except KubernetesApiError as exc:
            return [f"(events unavailable: {exc})"]
        return [f"{e.type or ''} {e.reason}: {e.message}".strip() for e in events]

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
        response = self.api.stream_log(self.pod, objects.CONTAINER_NAME, cursor.since_seconds())
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


def follow_status(group: LaunchedGroup, api: KubernetesApi, interval_s: float) -> None:
    """One list call per interval for the whole group updates every handle (never a call per poll)."""
    while not group.stop.is_set():
        try:
            pods = {p.metadata.name: p for p in api.list("pod", group.names.selector)}
        except KubernetesApiError as exc:
            log.warning("group %s: pod status unavailable: %s", group.spec.name, exc)
        else:
            for name, handle in list(group.handles.items()):
                handle._update(pods.get(name))
        group.stop.wait(interval_s)
    for handle in list(group.handles.values()):
        handle.started.set()  # a follower still waiting for a Pending pod ends now
