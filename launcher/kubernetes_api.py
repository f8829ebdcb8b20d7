"""The kubernetes backend's calls to the API server, through the official client's `CoreV1Api` and
`NetworkingV1Api`: explicit timeouts, transient errors retried (tenacity) after what the server asks for
(`Retry-After` on a 429 or 503) or with backoff, and refusals turned into
`KubernetesApiError` naming what was being done (and, for a 403, the Role and quota it needs)."""

from __future__ import annotations

import email.utils
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes.client import CoreV1Api, NetworkingV1Api, V1DeleteOptions
from kubernetes.client.rest import ApiException
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt

from launcher.errors import LaunchError

log = logging.getLogger(__name__)

# Status codes worth retrying: the API server overloaded or restarting, or a rate limit.
RETRIED_STATUSES = {429, 500, 502, 503, 504}
# A longer Retry-After is waited this long: the call's own retries and the task's timeouts bound the rest.
MAX_RETRY_AFTER_S = 60.0
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, ConnectionError, TimeoutError)
FORBIDDEN_HINT = (" (the identity of kubernetes_conn_id needs the Role of docs/backends.md's 'Cluster prerequisites' "
                  "in this namespace, and the namespace's ResourceQuota room for the pods)")


class KubernetesApiError(LaunchError):
    """The API server refused a call (RBAC, quota, validation) or stayed unreachable through the retries."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def transient(exc: BaseException) -> bool:
    """Worth another try: the API server overloaded, restarting or rate-limiting, or not answering."""
    return isinstance(exc, TRANSPORT_ERRORS) or (isinstance(exc, ApiException) and exc.status in RETRIED_STATUSES)


def retry_after(exc: BaseException | None, now: Callable[[], float] = time.time) -> float | None:
    """The seconds a 429 or 503 asks to wait (`Retry-After`: seconds, or an HTTP date), at most MAX_RETRY_AFTER_S;
    None when the answer names none."""
    if not isinstance(exc, ApiException) or exc.status not in (429, 503) or not exc.headers:
        return None
    value = next((v for k, v in exc.headers.items() if k.lower() == "retry-after"), None)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - now()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def backoff(state: RetryCallState) -> float:
    """What the server asked for, else 0.5 s doubling with each try."""
    asked = retry_after(state.outcome.exception() if state.outcome else None)
    return asked if asked is not None else 0.5 * 2 ** (state.attempt_number - 1)


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


class KubernetesApi:
    """The client calls with explicit timeouts, retries of transient errors (`backoff`), and API errors turned
    into `KubernetesApiError` naming what was being done. Every object lives in `namespace`."""

    def __init__(self, core: CoreV1Api, networking: NetworkingV1Api, namespace: str, *,
                 timeout: tuple[float, float], retries: int, sleep: Callable[[float], None]) -> None:
        self.core, self.networking, self.namespace, self.sleep = core, networking, namespace, sleep
        self.timeout = timeout  # (connect, read) seconds
        self.retries = retries  # after the first try

    def call(self, what: str, method: Callable[..., Any], *args: Any, missing_ok: bool = False,
             retries: int | None = None, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` with the timeout; transient errors retried `retries` times (default: the
        backend's), waiting what the server asks (`Retry-After`) or backing off; None for a 404 with `missing_ok`."""
        retries = self.retries if retries is None else retries

        def once() -> Any:
            try:
                return method(*args, _request_timeout=self.timeout, **kwargs)
            except ApiException as exc:
                if exc.status == 404 and missing_ok:
                    return None
                raise

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            reason = api_reason(exc) if isinstance(exc, ApiException) else str(exc)
            delay = state.next_action.sleep if state.next_action else 0.0
            log.warning("%s: %s; retrying in %g s (%d of %d)", what, reason, delay, state.attempt_number, retries)

        retrying = Retrying(retry=retry_if_exception(transient), stop=stop_after_attempt(retries + 1), wait=backoff,
                            sleep=self.sleep, before_sleep=before_sleep, reraise=True)
        try:
            return retrying(once)
        except ApiException as exc:
            hint = FORBIDDEN_HINT if exc.status == 403 else ""
            raise KubernetesApiError(f"{what} failed: {api_reason(exc)}{hint}", exc.status) from exc
        except TRANSPORT_ERRORS as exc:
            raise KubernetesApiError(f"{what} failed: the API server did not answer ({exc})") from exc

    def delete(self, kind: str, name: str, retries: int | None = None, **options: Any) -> bool:
        """Delete one object; False when it was already gone (404)."""
        ns = self.namespace
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
        ns = self.namespace
        method = {"pod": self.core.list_namespaced_pod, "service": self.core.list_namespaced_service,
                  "secret": self.core.list_namespaced_secret,
                  "networkpolicy": self.networking.list_namespaced_network_policy}[kind]
        return self.call(f"listing {kind}s {selector} in {ns}", method, ns, label_selector=selector).items

    def stream_log(self, pod: str, container: str, since_seconds: int | None) -> Any:
        """One follow stream of the container's log, each line after its timestamp, not retried: the caller
        reconnects, and handles `ApiException` and `TRANSPORT_ERRORS` itself."""
        return self.core.read_namespaced_pod_log(
            pod, self.namespace, container=container, follow=True, timestamps=True, since_seconds=since_seconds,
            _preload_content=False,
            # The provider's client would otherwise put its default read timeout on a quiet stream.
            _request_timeout=(self.timeout[0], None))
