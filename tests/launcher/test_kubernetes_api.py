"""The kubernetes backend's error paths at the client boundary: the official client's API objects are mocks that
answer as the API server would (ApiException with the server's Status body), as the provider's own tests do."""

from __future__ import annotations

import json
from unittest.mock import MagicMock

import pytest
import urllib3
from kubernetes.client import V1ObjectMeta, V1Service
from kubernetes.client.rest import ApiException

from launcher import GroupSpec, WorkerSpec
from launcher.kubernetes import KubernetesBackend, KubernetesSettings
from launcher.kubernetes_api import KubernetesApiError
from launcher.kubernetes_objects import GroupNames, PodSettings

SECRET = {"AWS_SECRET_ACCESS_KEY": "never-in-a-pod-spec"}


def api_error(status: int, reason: str, message: str) -> ApiException:
    exc = ApiException(status=status, reason={403: "Forbidden", 404: "Not Found", 409: "Conflict",
                                              500: "Internal Server Error", 503: "Service Unavailable"}[status])
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "reason": reason, "message": message,
                           "code": status})
    return exc


@pytest.fixture
def clients():
    core, networking = MagicMock(name="CoreV1Api"), MagicMock(name="NetworkingV1Api")
    core.create_namespaced_service.return_value = V1Service(metadata=V1ObjectMeta(name="svc", uid="uid-1"))
    core.list_namespaced_pod.return_value.items = []
    return core, networking


def make_backend(core, networking, sleeps: list[float] | None = None) -> KubernetesBackend:
    settings = KubernetesSettings(namespace="ml", pod=PodSettings(image="trainer:1"), status_interval_s=0.05)
    return KubernetesBackend(core, networking, settings, sleep=(sleeps if sleeps is not None else []).append)


def group(**changes) -> GroupSpec:
    return GroupSpec(**{"name": "train", "entrypoint": "trainer.train", "num_workers": 2, "run_key": "run-1",
                        "secret_env": SECRET, **changes})


def start_rank(backend: KubernetesBackend, spec: GroupSpec, rank: int = 0, tmp_path=None):
    placement = backend.place(spec)[rank]
    worker = WorkerSpec(rank=rank, num_workers=spec.num_workers, placement=placement,
                        log_file=str(tmp_path / f"rank-{rank}.log"), workdir=str(tmp_path))
    return backend.start(spec, worker, backend.command(spec), {"TF_CONFIG": "{}"})


def deleted(core, networking) -> set[tuple[str, str]]:
    calls = {("service", c.args[0]) for c in core.delete_namespaced_service.call_args_list}
    calls |= {("secret", c.args[0]) for c in core.delete_namespaced_secret.call_args_list}
    calls |= {("networkpolicy", c.args[0]) for c in networking.delete_namespaced_network_policy.call_args_list}
    return calls


def test_server_errors_are_retried_with_backoff_then_succeed(clients, tmp_path):
    core, networking = clients
    ok = core.create_namespaced_service.return_value
    core.create_namespaced_service.side_effect = [api_error(503, "ServiceUnavailable", "etcd leader changed"),
                                                  urllib3.exceptions.ProtocolError("connection reset"), ok]
    sleeps: list[float] = []
    backend = make_backend(core, networking, sleeps)
    handle = start_rank(backend, group(), tmp_path=tmp_path)
    assert core.create_namespaced_service.call_count == 3
    assert sleeps == [0.5, 1.0]
    assert core.create_namespaced_pod.call_count == 1
    for call in core.create_namespaced_service.call_args_list:
        assert call.kwargs["_request_timeout"] == (10.0, 30.0), "every call carries its own timeout"
    handle.group.stop.set()


def rate_limited(status: int, retry_after: str) -> ApiException:
    """What the API server (its priority and fairness, or a proxy before it) answers when it sheds load."""
    exc = ApiException(status=status, reason={429: "Too Many Requests", 503: "Service Unavailable"}[status])
    exc.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "TooManyRequests",
                           "message": "the server has received too many requests", "code": status})
    exc.headers = {"Content-Type": "application/json", "retry-after": retry_after}  # any case, as HTTP allows
    return exc


def test_a_rate_limit_is_waited_out_as_long_as_the_server_asks_then_backed_off(clients, tmp_path, caplog):
    core, networking = clients
    ok = core.create_namespaced_service.return_value
    core.create_namespaced_service.side_effect = [rate_limited(429, "7"), rate_limited(503, "3600"),
                                                  rate_limited(429, "soon"), ok]
    sleeps: list[float] = []
    handle = start_rank(make_backend(core, networking, sleeps), group(), tmp_path=tmp_path)
    # 7 s as asked, a too-long wait capped, and the backoff's third step when the header says no number or date.
    assert sleeps == [7.0, 60.0, 2.0]
    assert core.create_namespaced_service.call_count == 4
    assert "429 Too Many Requests: TooManyRequests: the server has received too many requests; retrying in 7 s " \
           "(1 of 4)" in caplog.text
    handle.group.stop.set()


def test_retry_after_reads_seconds_or_an_http_date_and_only_on_429_and_503():
    from launcher.kubernetes_api import retry_after

    assert retry_after(rate_limited(503, "Thu, 01 Jan 1970 00:00:30 GMT"), now=lambda: 10.0) == 20.0
    assert retry_after(rate_limited(429, "-5")) == 0.0
    refused = api_error(500, "InternalError", "etcdserver: request timed out")
    refused.headers = {"Retry-After": "9"}
    assert retry_after(refused) is None and retry_after(api_error(503, "x", "y")) is None
    assert retry_after(TimeoutError("read timed out")) is None


def test_server_errors_that_persist_fail_with_the_api_reason(clients, tmp_path):
    core, networking = clients
    core.create_namespaced_service.side_effect = api_error(500, "InternalError", "etcdserver: request timed out")
    sleeps: list[float] = []
    with pytest.raises(KubernetesApiError, match="creating service ml/.* failed: 500 Internal Server Error: "
                                                 "InternalError: etcdserver: request timed out"):
        start_rank(make_backend(core, networking, sleeps), group(), tmp_path=tmp_path)
    assert sleeps == [0.5, 1.0, 2.0, 4.0]
    core.create_namespaced_pod.assert_not_called()


@pytest.mark.parametrize("message", [
    ('pods is forbidden: User "system:serviceaccount:airflow:worker" cannot create resource "pods" in API group "" '
    'in the namespace "ml"'),
    ('pods "tfmw-train-run-1-0" is forbidden: exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=1, '
    'used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8'),
])
def test_a_refused_pod_fails_with_the_api_reason_and_leaves_nothing_behind(clients, tmp_path, message):
    core, networking = clients
    core.create_namespaced_pod.side_effect = api_error(403, "Forbidden", message)
    sleeps: list[float] = []
    with pytest.raises(KubernetesApiError) as excinfo:
        start_rank(make_backend(core, networking, sleeps), group(), tmp_path=tmp_path)
    assert f"403 Forbidden: {message}" in str(excinfo.value)
    assert sleeps == [], "a 403 is not retried"
    names = GroupNames("run-1", "train", "ml")
    assert {("service", names.service), ("secret", names.secret),
            ("networkpolicy", names.network_policy)} <= deleted(core, networking)


def test_conflicting_service_of_an_earlier_try_is_adopted(clients, tmp_path):
    core, networking = clients
    names = GroupNames("run-1", "train", "ml")
    core.create_namespaced_service.side_effect = api_error(409, "AlreadyExists", "services already exists")
    core.read_namespaced_service.return_value = V1Service(
        metadata=V1ObjectMeta(name=names.service, uid="uid-old", labels=names.selector_labels))
    handle = start_rank(make_backend(core, networking), group(), tmp_path=tmp_path)
    owner = core.create_namespaced_pod.call_args.args[1].metadata.owner_references[0]
    assert owner.uid == "uid-old"
    handle.group.stop.set()


def test_conflicting_service_of_someone_else_is_refused(clients, tmp_path):
    core, networking = clients
    core.create_namespaced_service.side_effect = api_error(409, "AlreadyExists", "services already exists")
    core.read_namespaced_service.return_value = V1Service(
        metadata=V1ObjectMeta(name="x", uid="uid-other", labels={"app": "web"}))
    with pytest.raises(KubernetesApiError, match="not this group's"):
        start_rank(make_backend(core, networking), group(), tmp_path=tmp_path)
    core.create_namespaced_pod.assert_not_called()


def test_a_pod_left_by_an_earlier_try_is_replaced(clients, tmp_path):
    core, networking = clients
    names = GroupNames("run-1", "train", "ml")
    core.create_namespaced_pod.side_effect = [api_error(409, "AlreadyExists", "pods already exists"), None]
    leftover = MagicMock()
    leftover.metadata.labels = names.pod_labels(0)
    core.read_namespaced_pod.side_effect = [leftover, api_error(404, "NotFound", "pods not found")]
    handle = start_rank(make_backend(core, networking), group(), tmp_path=tmp_path)
    assert core.create_namespaced_pod.call_count == 2
    delete = core.delete_namespaced_pod.call_args
    assert delete.args[:2] == (names.pod(0), "ml") and delete.kwargs["body"].grace_period_seconds == 0
    handle.group.stop.set()


def test_deleting_what_is_already_gone_is_fine(clients, tmp_path):
    core, networking = clients
    gone = api_error(404, "NotFound", "not found")
    core.delete_namespaced_service.side_effect = core.delete_namespaced_secret.side_effect = gone
    networking.delete_namespaced_network_policy.side_effect = core.delete_namespaced_pod.side_effect = gone
    backend = make_backend(core, networking)
    spec = group()
    handle = start_rank(backend, spec, tmp_path=tmp_path)
    handle.terminate()
    backend.end_group(spec)
    assert core.delete_namespaced_pod.called and core.delete_namespaced_service.called


def test_the_secret_is_referenced_never_inlined(clients, tmp_path):
    core, networking = clients
    handle = start_rank(make_backend(core, networking), group(), tmp_path=tmp_path)
    pod = core.create_namespaced_pod.call_args.args[1]
    assert "never-in-a-pod-spec" not in json.dumps(pod.to_dict(), default=str)
    assert pod.spec.containers[0].env_from[0].secret_ref.name == GroupNames("run-1", "train", "ml").secret
    secret = core.create_namespaced_secret.call_args.args[1]
    assert set(secret.data) == set(SECRET)
    handle.group.stop.set()
