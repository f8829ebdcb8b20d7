"""A small Kubernetes API server for tests, whose pods are real local processes.

It speaks the subset of the API the kubernetes backend uses, over real HTTP, so the official client and the
cncf.kubernetes provider's hook run unchanged against it: create / read / list by label / delete of pods,
services, secrets (core v1) and network policies (networking.k8s.io/v1) in any namespace, delete by label,
events, and `pods/<name>/log` with `follow`, `timestamps` and `sinceSeconds` as a chunked stream.

A created pod starts its container's `command` as a local process (its own session), with the pod's environment
resolved the way a kubelet would (literal `env`, `secretKeyRef`, `envFrom.secretRef`) on top of `image_env`, the
"image's" environment. Its phase follows the process: Pending -> Running -> Succeeded / Failed with the exit code
(128 + signal when killed, as container runtimes report). A pod whose Secret is missing stays Pending with a
CreateContainerConfigError event. DELETE of a pod sends SIGTERM to its process group, waits the grace period,
sends SIGKILL, and only then does the pod disappear (404); until then it is listed with its `deletionTimestamp`. A
forced deletion (`gracePeriodSeconds: 0`) drops the pod object at once, as a real API server does, while its
"kubelet" kills the process afterwards. Deleting an owner garbage-collects its dependents (ownerReferences), unless
`propagationPolicy` is Orphan.

Test hooks: `tf_address(dns)` is the loopback `127.0.0.1:<port>` a pod DNS name resolves to (every TF_CONFIG is
rewritten this way before the process starts; each rank gets its own port because TensorFlow binds 0.0.0.0);
`hold_pending(pattern, reason, message)` keeps matching pods Pending with that event; `refuse(verb, resource, code,
reason, message)` answers matching requests with an API error; `cut_log_streams_after(n, times)` drops the first log
streams of each pod after n lines (the client must reconnect); `kill_pod_process(name, sig)` is a container crash;
`slow_termination(pattern, seconds)` makes the kubelet end matching pods only that long after their delete (a node
under pressure, a process stuck in the GPU driver). `deletions` lists every pod delete (name, grace asked, when),
`ended_at(name)` when the pod's process ended.
"""

from __future__ import annotations

import base64
import fnmatch
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, urlparse

from tests.support.http import send_json

_CORE = re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<res>pods|services|secrets|events)"
                   r"(?:/(?P<name>[^/]+)(?:/(?P<sub>log))?)?$")
_NETWORKING = re.compile(r"^/apis/networking\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/(?P<res>networkpolicies)"
                         r"(?:/(?P<name>[^/]+))?$")
_CLUSTER = re.compile(r"^/api/v1/(?P<res>nodes|pods)$")  # cluster-wide lists: the nodes, every namespace's pods
_KINDS = {"pods": ("Pod", "v1"), "services": ("Service", "v1"), "secrets": ("Secret", "v1"),
          "events": ("Event", "v1"), "networkpolicies": ("NetworkPolicy", "networking.k8s.io/v1")}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stamp(t: float) -> str:
    """RFC3339Nano as the kubelet writes it with `timestamps=true`."""
    whole = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{whole}.{int((t % 1) * 1e9):09d}Z"


def _pod_port_block(size: int = 1000) -> range:
    """Loopback ports for pod addresses: below the kernel's ephemeral range, one block per pytest-xdist worker.

    A port that bind(0) found free stays free only by luck until a pod's TF server binds it, seconds later: any
    process's bind(0) or outgoing connection may take it meanwhile, and the suite's other worker starts TF servers,
    agents and API servers all the time. A rank that then reaches a foreign server fails its collectives."""
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as handle:
        ephemeral_low = int(handle.read().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    top = ephemeral_low - worker * size
    return range(top - size, top)


_POD_PORT_BLOCK = _pod_port_block()
_POD_PORTS = itertools.cycle(_POD_PORT_BLOCK)
_POD_PORTS_LOCK = threading.Lock()


def pod_port() -> int:
    """The next port of this worker's block that nothing holds now (pods of earlier tests may still hold some)."""
    with _POD_PORTS_LOCK:
        for port in itertools.islice(_POD_PORTS, len(_POD_PORT_BLOCK)):
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no free port left in {_POD_PORT_BLOCK}")


def _status(code: int, reason: str, message: str, name: str = "", kind: str = "") -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": {"name": name, "kind": kind}, "code": code}


def _matches(labels: Mapping[str, str], selector: str) -> bool:
    """Equality-based label selectors (`a=b,c=d`, `a==b`, `a!=b`, `a`), all the backend uses."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class _Pod:
    """The kubelet's side of one pod: its process, its log lines (with times) and its container state."""

    body: dict
    workdir: Path
    process: subprocess.Popen | None = None
    lines: list[tuple[float, bytes]] = field(default_factory=list)
    started_at: str | None = None
    finished_at: str | None = None
    waiting: tuple[str, str] | None = None  # (reason, message) while the container cannot start
    env: dict[str, str] | None = None  # the container's resolved environment
    deleting: bool = False
    ended_at: float | None = None  # time.monotonic() when the process was seen ended
    output_done: threading.Event = field(default_factory=threading.Event)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def exit_code(self) -> int | None:
        code = self.process.poll() if self.process else None
        return None if code is None else (128 - code if code < 0 else code)

    def status(self) -> dict:
        status: dict = {"hostIP": "127.0.0.1", "podIP": "127.0.0.1", "conditions": []}
        code = self.exit_code()
        if code is not None and self.output_done.is_set():
            state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                    "startedAt": self.started_at, "finishedAt": self.finished_at or _now()}}
            status["phase"] = "Succeeded" if code == 0 else "Failed"
        elif self.process:
            state = {"running": {"startedAt": self.started_at}}
            status["phase"] = "Running"
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, "message": message}}
            status["phase"] = "Pending"
            if reason == "Unschedulable":
                status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": reason,
                                         "message": message}]
                return status
        status["containerStatuses"] = [{"name": c["name"], "image": c["image"], "imageID": "",
                                        "ready": "running" in state, "restartCount": 0, "state": state}
                                       for c in self.body["spec"]["containers"][:1]]
        return status


class FakeKubernetes:
    """The API server and its "kubelet". Use as a context manager; `url` is the server address."""

    def __init__(self, image_env: Mapping[str, str] | None = None) -> None:
        self.image_env = dict(image_env or {})
        self.node_name = "fake-node-1"
        self.nodes: dict[str, dict] = {}  # add_node(); none by default
        self.objects: dict[tuple[str, str, str], dict] = {}  # (resource, namespace, name) -> object
        self.pods: dict[tuple[str, str], _Pod] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for assertions
        self.created: dict[tuple[str, str], dict] = {}  # (resource, name) -> the body as created, kept after deletion
        self._history: dict[str, _Pod] = {}  # pod name -> its last kubelet record, kept after deletion
        self.deletions: list[tuple[str, Any, float]] = []  # (pod, gracePeriodSeconds asked, time.monotonic())
        self._slow: list[tuple[str, float]] = []  # (pod pattern, seconds the kubelet takes to act on a delete)
        self._lock = threading.RLock()
        self._addresses: dict[str, str] = {}
        self._pending: list[tuple[str, str, str]] = []
        self._refusals: list[list] = []  # [verb, resource, code, reason, message, requests still let through]
        self._cut_after: int | None = None
        self._cuts_left = 0
        self._cuts: dict[str, int] = {}  # pod -> streams dropped so far
        self._tmp = tempfile.TemporaryDirectory(prefix="fake-k8s-")
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- lifecycle and hooks -----------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        threading.Thread(target=self._server.serve_forever, daemon=True, name="fake-k8s").start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            pods = list(self._history.values())  # also force-deleted pods whose process may still run
        for pod in pods:
            if pod.process and pod.process.poll() is None:
                os.killpg(pod.process.pid, signal.SIGKILL)
                pod.process.wait(10)
        self._server.shutdown()
        self._server.server_close()
        self._tmp.cleanup()

    def kubeconfig(self, namespace: str = "default") -> dict:
        """A kubeconfig (as a dict) pointing at this server, with a token the server does not check."""
        return {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": "fake-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester",
                                                          "namespace": namespace}}]}

    def tf_address(self, address: str) -> str:
        """Where `host:port` of a TF_CONFIG reaches from a pod here: a distinct loopback port per address."""
        with self._lock:
            if address not in self._addresses:
                self._addresses[address] = f"127.0.0.1:{pod_port()}"
            return self._addresses[address]

    def hold_pending(self, pod_pattern: str, reason: str = "Unschedulable",
                     message: str = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.") -> None:
        """Pods whose name matches stay Pending: `Unschedulable` (FailedScheduling) or an image error such as
        `ErrImagePull` (event reason Failed)."""
        self._pending.append((pod_pattern, reason, message))

    def refuse(self, verb: str, resource: str, code: int, reason: str, message: str, after: int = 0) -> None:
        """Answer `verb` (create, get, list, delete) on `resource` with this error (e.g. 403 Forbidden) once
        `after` such requests went through (a quota that admits the first pods)."""
        self._refusals.append([verb, resource, code, reason, message, after])

    def cut_log_streams_after(self, lines: int, times: int = 2) -> None:
        """Drop the first `times` log streams of every pod after `lines` lines each (a dropped connection)."""
        self._cut_after, self._cuts_left = lines, times

    def slow_termination(self, pod_pattern: str, seconds: float) -> None:
        """The kubelet acts on a delete of a matching pod only `seconds` after it (whatever the grace period): the
        process lives that long, and a gracefully deleted pod stays listed until it has ended."""
        self._slow.append((pod_pattern, seconds))

    def ended_at(self, name: str) -> float | None:
        """time.monotonic() when the pod's process ended; None while it runs (or never started)."""
        record = self._history.get(name)
        return record.ended_at if record else None

    def kill_pod_process(self, name: str, sig: int = signal.SIGKILL, namespace: str = "default") -> None:
        pod = self.pods[(namespace, name)]
        os.killpg(pod.process.pid, sig)

    def names(self, resource: str, namespace: str = "default") -> list[str]:
        with self._lock:
            return sorted(n for (r, ns, n) in self.objects if r == resource and ns == namespace)

    def remaining(self, namespace: str = "default") -> dict[str, list[str]]:
        """Every stored object but events, by resource: {} when nothing is left."""
        found: dict[str, list[str]] = {}
        with self._lock:
            for resource, ns, name in self.objects:
                if ns == namespace and resource != "events":
                    found.setdefault(resource, []).append(name)
        return found

    def names_created(self, resource: str) -> list[str]:
        return sorted(name for r, name in self.created if r == resource)

    def created_body(self, pod: str) -> dict:
        return self.created[("pods", pod)]

    def created_env(self, pod: str) -> dict[str, str]:
        """The environment the pod's process got (TF_CONFIG as the pod spec has it, before loopback rewriting)."""
        return self._history[pod].env

    def log_of(self, pod: str) -> bytes:
        record = self._history.get(pod)
        return b"".join(line for _, line in record.lines) if record else b""

    def process_of(self, name: str, namespace: str = "default") -> subprocess.Popen | None:
        pod = self.pods.get((namespace, name))
        return pod.process if pod else None

    # -- the API ---------------------------------------------------------------------------------------------

    def _refusal(self, verb: str, resource: str) -> dict | None:
        with self._lock:
            for refusal in self._refusals:
                v, r, code, reason, message, after = refusal
                if v == verb and r == resource:
                    if after > 0:
                        refusal[5] -= 1
                        return None
                    return _status(code, reason, message)
        return None

    def add_node(self, name: str, allocatable: Mapping[str, str], *, labels: Mapping[str, str] | None = None,
                 taints: tuple[dict, ...] = (), ready: bool = True, unschedulable: bool = False) -> None:
        """A node of the cluster, as `kubectl get node -o json` shows it (the parts capacity reads)."""
        self.nodes[name] = {
            "kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"unschedulable": unschedulable, "taints": list(taints) or None},
            "status": {"allocatable": dict(allocatable), "capacity": dict(allocatable),
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    def _cluster_list(self, resource: str, query: dict[str, str]) -> tuple[int, dict]:
        refused = self._refusal("list", resource)
        if refused:
            return refused["code"], refused
        with self._lock:
            if resource == "nodes":
                return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": list(self.nodes.values())}
            items = [self._view("pods", ns, o) for (r, ns, _), o in self.objects.items()
                     if r == "pods" and self._selected(o, query)]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}

    def handle(self, method: str, path: str, query: dict[str, str], body: dict | None) -> tuple[int, dict]:
        cluster = _CLUSTER.match(path)
        if cluster and method == "GET":
            return self._cluster_list(cluster["res"], query)
        match = _CORE.match(path) or _NETWORKING.match(path)
        if not match:
            return 404, _status(404, "NotFound", f"the server could not find the requested resource ({path})")
        ns, resource, name = match["ns"], match["res"], match["name"]
        verb = {"POST": "create", "GET": "get" if name else "list", "DELETE": "delete"}.get(method, method.lower())
        refused = self._refusal(verb, resource)
        if refused:
            return refused["code"], refused
        with self._lock:
            if method == "POST" and not name:
                kind, api_version = _KINDS[resource]
                return self._create(resource, ns, kind, api_version, body or {})
            if method == "GET":
                return self._read(resource, ns, name, query)
            if method == "DELETE":
                return self._remove(resource, ns, name, query, body or {})
        return 405, _status(405, "MethodNotAllowed", f"{method} is not supported here")

    def _read(self, resource: str, ns: str, name: str | None, query: dict[str, str]) -> tuple[int, dict]:
        """GET of one object by name, or of those the label selector picks."""
        if name:
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found', name, resource)
            return 200, self._view(resource, ns, obj)
        kind, api_version = _KINDS[resource]
        items = [self._view(resource, ns, o) for (r, n, _), o in self.objects.items()
                 if r == resource and n == ns and self._selected(o, query)]
        return 200, {"kind": f"{kind}List", "apiVersion": api_version, "metadata": {"resourceVersion": "1"},
                     "items": items}

    def _remove(self, resource: str, ns: str, name: str | None, query: dict[str, str],
                body: dict) -> tuple[int, dict]:
        """DELETE of one object by name, or of those the label selector picks (a collection delete)."""
        if name:
            obj = self.objects.get((resource, ns, name))
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found', name, resource)
            self._delete(resource, ns, name, body)
            return 200, self._view(resource, ns, obj)
        kind, api_version = _KINDS[resource]
        doomed = [(n, o) for (r, s, n), o in self.objects.items()
                  if r == resource and s == ns and self._selected(o, query)]
        for n, _ in doomed:
            self._delete(resource, ns, n, body)
        return 200, {"kind": f"{kind}List", "apiVersion": api_version, "metadata": {},
                     "items": [self._view(resource, ns, o) for _, o in doomed]}

    @staticmethod
    def _selected(obj: dict, query: Mapping[str, str]) -> bool:
        if not _matches(obj["metadata"].get("labels") or {}, query.get("labelSelector", "")):
            return False
        for term in filter(None, query.get("fieldSelector", "").split(",")):
            key, value = term.split("=", 1)
            node = obj
            for part in key.split("."):
                node = node.get(part, {}) if isinstance(node, dict) else {}
            if node != value:
                return False
        return True

    def _view(self, resource: str, ns: str, obj: dict) -> dict:
        if resource == "pods":
            pod = self.pods.get((ns, obj["metadata"]["name"]))
            if pod:
                return {**obj, "status": pod.status()}
        return obj

    def _create(self, resource: str, ns: str, kind: str, api_version: str, body: dict) -> tuple[int, dict]:
        name = body.get("metadata", {}).get("name", "")
        if (resource, ns, name) in self.objects:
            return 409, _status(409, "AlreadyExists", f'{resource} "{name}" already exists', name, resource)
        obj = {**body, "kind": kind, "apiVersion": api_version}
        obj["metadata"] = {**body.get("metadata", {}), "namespace": ns, "uid": str(uuid.uuid4()),
                           "creationTimestamp": _now(), "resourceVersion": "1"}
        self.objects[(resource, ns, name)] = obj
        self.created[(resource, name)] = json.loads(json.dumps(obj))
        if resource == "pods":
            pod = _Pod(obj, Path(self._tmp.name) / ns / name)
            self.pods[(ns, name)] = pod
            self._history[name] = pod
            threading.Thread(target=self._start_pod, args=(ns, pod), daemon=True, name=f"kubelet-{name}").start()
        return 201, self._view(resource, ns, obj)

    def _event(self, ns: str, pod_name: str, reason: str, message: str) -> None:
        name = f"{pod_name}.{uuid.uuid4().hex[:12]}"
        self.objects[("events", ns, name)] = {
            "kind": "Event", "apiVersion": "v1", "type": "Warning", "reason": reason, "message": message,
            "metadata": {"name": name, "namespace": ns}, "count": 1, "firstTimestamp": _now(),
            "lastTimestamp": _now(), "involvedObject": {"kind": "Pod", "name": pod_name, "namespace": ns}}

    def _delete(self, resource: str, ns: str, name: str, options: dict) -> None:
        obj = self.objects[(resource, ns, name)]
        policy = options.get("propagationPolicy") or "Background"
        uid = obj["metadata"]["uid"]
        for (r, s, n), dependent in list(self.objects.items()):
            owners = dependent["metadata"].get("ownerReferences") or []
            if s != ns or not any(o.get("uid") == uid for o in owners):
                continue
            if policy == "Orphan":
                dependent["metadata"]["ownerReferences"] = [o for o in owners if o.get("uid") != uid] or None
            elif all(o.get("uid") == uid or not self._uid_exists(ns, o.get("uid")) for o in owners):
                self._delete(r, s, n, {})
        if resource != "pods":
            del self.objects[(resource, ns, name)]
            return
        pod = self.pods[(ns, name)]
        self.deletions.append((name, options.get("gracePeriodSeconds"), time.monotonic()))
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = obj["spec"].get("terminationGracePeriodSeconds", 30)
        obj["metadata"].setdefault("deletionTimestamp", _now())
        if grace == 0:  # forced: the object goes now, whatever the node still runs
            del self.objects[(resource, ns, name)]
            del self.pods[(ns, name)]
        if not pod.deleting or grace == 0:
            pod.deleting = True
            delay = max((seconds for pattern, seconds in self._slow if fnmatch.fnmatch(name, pattern)), default=0.0)
            threading.Thread(target=self._stop_pod, args=(ns, name, pod, float(grace), delay), daemon=True).start()

    def _uid_exists(self, ns: str, uid: str) -> bool:
        return any(s == ns and o["metadata"]["uid"] == uid for (_, s, _), o in self.objects.items())

    # -- the "kubelet" ---------------------------------------------------------------------------------------

    def _resolve_env(self, ns: str, container: dict) -> tuple[dict[str, str] | None, Any]:
        """(environment of the process, the environment as the pod spec gives it) or (None, the problem)."""
        def secret(name: str) -> dict[str, str] | None:
            obj = self.objects.get(("secrets", ns, name))
            if obj is None:
                return None
            return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()} | \
                dict(obj.get("stringData") or {})

        env = dict(self.image_env)
        for source in container.get("envFrom") or []:
            ref = source.get("secretRef", {}).get("name")
            values = secret(ref)
            if values is None:
                return None, f'secret "{ref}" not found'
            env.update(values)
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = var["value"]
            elif "secretKeyRef" in (var.get("valueFrom") or {}):
                ref = var["valueFrom"]["secretKeyRef"]
                values = secret(ref["name"])
                if values is None or ref["key"] not in values:
                    return None, f'couldn\'t find key {ref["key"]} in Secret {ns}/{ref["name"]}'
                env[var["name"]] = values[ref["key"]]
        given = dict(env)
        if "TF_CONFIG" in env:
            tf_config = json.loads(env["TF_CONFIG"])
            tf_config["cluster"] = {job: [self.tf_address(a) for a in addresses]
                                    for job, addresses in tf_config["cluster"].items()}
            env["TF_CONFIG"] = json.dumps(tf_config)
        return env, given

    def _start_pod(self, ns: str, pod: _Pod) -> None:
        name = pod.body["metadata"]["name"]
        for pattern, reason, message in self._pending:
            if fnmatch.fnmatch(name, pattern):
                with self._lock:
                    pod.waiting = (reason, message)
                    self._event(ns, name, "FailedScheduling" if reason == "Unschedulable" else "Failed",
                                message if reason == "Unschedulable" else f"Failed to pull image: {message}")
                return
        container = pod.body["spec"]["containers"][0]
        with self._lock:
            if pod.deleting:
                return
            pod.body["spec"]["nodeName"] = self.node_name  # scheduled
            env, given = self._resolve_env(ns, container)
            if env is None:
                pod.waiting = ("CreateContainerConfigError", given)
                self._event(ns, name, "Failed", f"Error: {given}")
                return
            pod.env = given
            pod.workdir.mkdir(parents=True, exist_ok=True)
            pod.process = subprocess.Popen(
                [*container["command"], *(container.get("args") or [])], cwd=pod.workdir, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            pod.started_at = _now()
        for line in iter(pod.process.stdout.readline, b""):
            with pod.changed:
                pod.lines.append((time.time(), line))
                pod.changed.notify_all()
        pod.process.wait()
        pod.ended_at = pod.ended_at or time.monotonic()
        pod.finished_at = _now()
        with pod.changed:
            pod.output_done.set()
            pod.changed.notify_all()

    def _stop_pod(self, ns: str, name: str, pod: _Pod, grace_s: float, delay_s: float = 0.0) -> None:
        time.sleep(delay_s)  # a slow kubelet
        if pod.process and pod.process.poll() is None:
            try:
                os.killpg(pod.process.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                pod.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(pod.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                pod.process.wait()
        if pod.process:
            pod.ended_at = pod.ended_at or time.monotonic()
        with self._lock:
            if self.pods.get((ns, name)) is pod:
                self.objects.pop(("pods", ns, name), None)
                del self.pods[(ns, name)]
        with pod.changed:
            pod.output_done.set()
            pod.changed.notify_all()

    def stream_log(self, ns: str, name: str, query: Mapping[str, str], write) -> tuple[int, dict] | None:
        """Write the pod's log through `write(bytes)`. Returns an error (status, body) when there is no log to
        read, (0, {}) when the stream was cut on purpose, None at its normal end."""
        with self._lock:
            pod = self.pods.get((ns, name))
            if pod is None:
                return 404, _status(404, "NotFound", f'pods "{name}" not found', name, "pods")
            if pod.process is None:
                reason = (pod.waiting or ("ContainerCreating", ""))[0]
                return 400, _status(400, "BadRequest",
                                    f'container "worker" in pod "{name}" is waiting to start: {reason}')
        # Booleans as Go's ParseBool reads them: the Python client sends "True".
        follow = query.get("follow", "").lower() in ("true", "1")
        timestamps = query.get("timestamps", "").lower() in ("true", "1")
        since = time.time() - float(query["sinceSeconds"]) if "sinceSeconds" in query else None
        index, sent = 0, 0
        with self._lock:
            cut_this = self._cut_after is not None and self._cuts.get(name, 0) < self._cuts_left
            if cut_this:
                self._cuts[name] = self._cuts.get(name, 0) + 1
        while True:
            with pod.changed:
                while index >= len(pod.lines) and follow and not pod.output_done.is_set():
                    pod.changed.wait(1.0)
                batch = pod.lines[index:]
                index = len(pod.lines)
                done = pod.output_done.is_set() and index == len(pod.lines)
            for at, line in batch:
                if since is not None and at < since:
                    continue
                write((_stamp(at).encode() + b" " if timestamps else b"") + line)
                sent += 1
                if cut_this and sent >= self._cut_after:
                    return 0, {}  # dropped: the connection closes without the final chunk
            if done or not follow:
                return None

    def _handler_class(self) -> type[_ApiHandler]:
        return type("Handler", (_ApiHandler,), {"cluster": self})


class _ApiHandler(BaseHTTPRequestHandler):
    """HTTP for one `FakeKubernetes`: JSON requests to `handle`, pod logs as a chunked stream."""

    protocol_version = "HTTP/1.1"
    cluster: FakeKubernetes  # set on the subclass each server makes

    def log_message(self, *args) -> None:
        pass

    def _respond(self, code: int, body: dict) -> None:
        send_json(self, code, body)

    def _dispatch(self) -> None:
        url = urlparse(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.cluster.requests.append((self.command, url.path))
        log = _CORE.match(url.path)
        if log and log["sub"] == "log" and self.command == "GET":
            self._stream(log["ns"], log["name"], query)
            return
        self._respond(*self.cluster.handle(self.command, url.path, query, body))

    def _stream(self, ns: str, name: str, query: dict[str, str]) -> None:
        started = False

        def write(chunk: bytes) -> None:
            nonlocal started
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                started = True
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.flush()

        refused = self.cluster._refusal("log", "pods")
        error = refused and (refused["code"], refused)
        self.close_connection = True
        try:
            error = error or self.cluster.stream_log(ns, name, query, write)
            if error and error[0] and not started:
                self._respond(*error)
                return
            if error and not error[0]:
                return  # cut: no terminating chunk, the client sees a broken stream
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _dispatch
