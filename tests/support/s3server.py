"""A real S3-protocol server (moto's threaded server) on loopback, and a proxy that makes it fail on purpose.

Use from a test module with `pytest_plugins = ["tests.support.s3server"]`, then request:
- `s3_endpoint`: the server's URL (one server per session, random free port on 127.0.0.1, or on the test hosts'
  network gateway when they have network stacks of their own, so that they reach it too: tests/conftest.py);
- `s3_env`: AWS_* variables for this test (dummy keys, region, AWS_ENDPOINT_URL), the only way
  `core.storage` and child processes learn the endpoint and credentials;
- `s3_bucket`: `s3_env` plus a fresh bucket; yields `"s3://<bucket>"`;
- `s3_faults`: an `S3FaultProxy` between the clients and the server (AWS_ENDPOINT_URL points at it) that can
  fail every object PUT after the first N, or hold the N-th PUT until released (to kill a writer mid-upload).
"""

from __future__ import annotations

import http.client
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

ACCESS_KEY = "test-access-key"
SECRET_KEY = "test-secret-key"
REGION = "us-east-1"


@pytest.fixture(scope="session")
def s3_endpoint(host_network):
    from moto.server import ThreadedMotoServer

    address = host_network.gateway if host_network else "127.0.0.1"
    server = ThreadedMotoServer(ip_address=address, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _set_env(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    _set_env(monkeypatch, s3_endpoint)
    return s3_endpoint


@pytest.fixture
def s3_bucket(s3_env):
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=name)
    return f"s3://{name}"


class S3FaultProxy:
    """HTTP proxy in front of the S3 server. Object PUTs (a key after the bucket) are counted; with
    `fail_after(n)` every object PUT after the n-th answers 500 InternalError, with `hold_at(n)` the n-th
    waits until `release()` and then fails. Everything else passes through unchanged; `got_bytes` counts the bytes
    of the GET answers (what clients read from storage)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.removeprefix("http://")
        self.object_puts = 0
        self.failed_puts = 0
        self.got_bytes = 0
        self.held = threading.Event()
        self._release = threading.Event()
        self._fail_after: int | None = None
        self._hold_at: int | None = None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail_after(self, puts: int) -> None:
        self._fail_after = puts

    def hold_at(self, put: int) -> None:
        self._hold_at = put

    def heal(self) -> None:
        self._fail_after = self._hold_at = None
        self.release()

    def release(self) -> None:
        self._release.set()

    def start(self) -> S3FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _verdict(self, method: str, path: str) -> str:
        """pass | fail | hold for one request."""
        if method != "PUT" or path.split("?", 1)[0].strip("/").count("/") < 1:
            return "pass"
        with self._lock:
            self.object_puts += 1
            count = self.object_puts
        if self._hold_at is not None and count == self._hold_at:
            return "hold"
        if self._fail_after is not None and count > self._fail_after:
            return "fail"
        return "pass"

    def _handler(self) -> type[_ProxyHandler]:
        return type("Handler", (_ProxyHandler,), {"proxy": self})


class _ProxyHandler(BaseHTTPRequestHandler):
    """One connection to an `S3FaultProxy`: every request passes, fails or waits as the proxy says."""

    protocol_version = "HTTP/1.1"
    proxy: S3FaultProxy  # set on the subclass each proxy makes

    def log_message(self, *args):  # keep test output quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self):
        body = self._body()
        verdict = self.proxy._verdict(self.command, self.path)
        if verdict == "hold":
            self.proxy.held.set()
            self.proxy._release.wait()
            verdict = "fail"
        if verdict == "fail":
            with self.proxy._lock:
                self.proxy.failed_puts += 1
            payload = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
                       b"<Message>injected by S3FaultProxy</Message></Error>")
            self.send_response(500)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("transfer-encoding", "host", "expect")}
        headers["Host"] = self.proxy.upstream
        headers["Content-Length"] = str(len(body))
        upstream = http.client.HTTPConnection(self.proxy.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        self.send_response(response.status)
        passed = ("transfer-encoding", "connection", "date", "server")
        for key, value in response.getheaders():
            # A HEAD answer's Content-Length is the object's size, not this (empty) body's.
            if key.lower() not in passed and (self.command == "HEAD" or key.lower() != "content-length"):
                self.send_header(key, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        if self.command == "GET":
            with self.proxy._lock:
                self.proxy.got_bytes += len(data)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward


@pytest.fixture
def s3_faults(s3_endpoint, monkeypatch):
    """An `S3FaultProxy` that every S3 client of this test (and its child processes) talks to. botocore's own
    retries are limited to one attempt so an injected failure surfaces in seconds rather than after backoff."""
    proxy = S3FaultProxy(s3_endpoint).start()
    _set_env(monkeypatch, proxy.endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def s3_faulty_bucket(s3_faults):
    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_faults.endpoint).create_bucket(Bucket=name)
    return f"s3://{name}"
