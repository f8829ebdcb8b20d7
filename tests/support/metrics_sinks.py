"""Real servers for the monitoring tests: a StatsD UDP listener and an SMTP server (aiosmtpd), both on loopback.

Each records what arrives with its arrival time, so a test can say a metric came while a task still ran.
"""

from __future__ import annotations

import email
import email.policy
import html
import re
import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class StatsdPacket:
    """One StatsD line: `name`, InfluxDB-style `tags`, value and type (`g`, `c`, `ms`), and when it arrived."""

    name: str
    tags: dict[str, str]
    value: float
    kind: str
    received: float  # time.time()


_LINE = re.compile(r"^(?P<stat>[^:]+):(?P<value>[-+0-9.eE]+)\|(?P<kind>[a-z]+)")


def parse_statsd(line: str, received: float) -> StatsdPacket | None:
    match = _LINE.match(line)
    if not match:
        return None
    name, *tags = match["stat"].split(",")
    return StatsdPacket(name, dict(tag.split("=", 1) for tag in tags), float(match["value"]), match["kind"], received)


class StatsdListener:
    """A UDP socket on 127.0.0.1 collecting StatsD packets in a thread; `stop()` closes it."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.settimeout(0.2)
        self.port = self._socket.getsockname()[1]
        self.packets: list[StatsdPacket] = []
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._receive, name="statsd-listener", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while self._running:
            try:
                data = self._socket.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            now = time.time()
            parsed = [parse_statsd(line, now) for line in data.decode("utf-8", "replace").splitlines()]
            with self._lock:
                self.packets += [packet for packet in parsed if packet]

    def matching(self, name_suffix: str, **tags: str) -> list[StatsdPacket]:
        with self._lock:
            return [p for p in self.packets if p.name.endswith(name_suffix)
                    and all(p.tags.get(k) == v for k, v in tags.items())]

    def stop(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self._socket.close()


class SmtpSink:
    """An aiosmtpd server on 127.0.0.1 keeping every message it accepts (`messages`: email.message objects)."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self.messages: list[email.message.EmailMessage] = []
        sink = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                sink.messages.append(email.message_from_bytes(envelope.content, policy=email.policy.default))
                return "250 Message accepted for delivery"

        with socket.socket() as probe:  # a free port: Controller's own port=0 support varies by version
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self._controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self._controller.start()

    def connection_uri(self) -> str:
        """An `AIRFLOW_CONN_*` value for this server: plain SMTP, no login, a short timeout and no retries."""
        return (f"smtp://127.0.0.1:{self.port}/?disable_ssl=true&disable_tls=true&timeout=5&retry_limit=0"
                "&from_email=airflow%40example.com")

    @staticmethod
    def text(message: email.message.EmailMessage) -> str:
        """The body as a reader sees it: the HTML's text, entities decoded."""
        body = message.get_body(preferencelist=("html", "plain"))
        return html.unescape(re.sub(r"<[^>]+>", "", body.get_content())) if body else ""

    def stop(self) -> None:
        if self._controller._thread is not None:  # stopped once already (a test took the server down)
            self._controller.stop()


class StallingSmtpServer:
    """A TCP server on 127.0.0.1 that accepts and then stops answering: at once (`stall_at=None`: no greeting, the
    server that never answers), or at the first command starting with `stall_at` ("RCPT": greeting, EHLO and MAIL
    answered). It holds every connection open until `stop()`; `connections` counts the accepted ones."""

    def __init__(self, stall_at: str | None = None) -> None:
        self.stall_at = stall_at.upper().encode() if stall_at else None
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._socket.settimeout(0.2)
        self.port = self._socket.getsockname()[1]
        self.connections = 0
        self._held: list[socket.socket] = []
        self._running = True
        self._thread = threading.Thread(target=self._accept, name="stalling-smtp", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while self._running:
            try:
                conn, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            self._held.append(conn)
            if self.stall_at is not None:
                threading.Thread(target=self._answer_until_stall, args=(conn,), daemon=True).start()

    def _answer_until_stall(self, conn: socket.socket) -> None:
        try:
            conn.sendall(b"220 stalling\r\n")
            for line in conn.makefile("rb"):
                if line.upper().startswith(self.stall_at):
                    return  # silent from here on, the connection held open
                if line.upper().startswith(b"EHLO"):
                    conn.sendall(b"250-stalling\r\n250 8BITMIME\r\n")
                else:
                    conn.sendall(b"250 ok\r\n")
        except OSError:
            return

    def connection_uri(self, **extra: str) -> str:
        """An `AIRFLOW_CONN_*` value: plain SMTP, the provider's defaults (timeout 30 s, 5 retries) unless `extra`
        sets them."""
        query = "&".join(f"{k}={v}" for k, v in {"disable_ssl": "true", "disable_tls": "true",
                                                   "from_email": "airflow%40example.com", **extra}.items())
        return f"smtp://127.0.0.1:{self.port}/?{query}"

    def stop(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        for conn in self._held:
            conn.close()
        self._socket.close()
