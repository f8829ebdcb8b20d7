"""The SSH backend's calls to its hosts' agents (`launcher.agent`): one SSH connection per host (paramiko, made by
the Airflow side from an SSH connection with host-key checking), one session channel per agent call, and every host
asked at once. A host that cannot be reached, refuses us, or whose agent fails is a HostError naming the host and
the fix.
"""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from core.protocol import AGENT_MODULE
from launcher.errors import LaunchError

REQUEST_TIMEOUT_S = 30.0
MAX_PARALLEL_REQUESTS = 16  # SSH sessions opened at once when asking every host (probe, release)


@dataclass(frozen=True)
class RemoteHost:
    """One SSH host: its connection id (for messages and records), the address its peers reach it at (it goes
    into TF_CONFIG), and how to connect (a paramiko `SSHClient` with host keys checked)."""

    conn_id: str
    address: str
    connect: Callable[[], Any]

    def __str__(self) -> str:
        return f"{self.address} (connection {self.conn_id})"


class HostError(LaunchError):
    """A host could not be reached, refused us, or its agent failed; the message names the host and the fix."""


class AgentClient:
    """The hosts' agents, asked over one cached SSH connection per host (hosts connect in parallel)."""

    def __init__(self, remote_python: str) -> None:
        self.remote_python = remote_python
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._host_locks: dict[str, threading.Lock] = {}

    def client(self, host: RemoteHost) -> Any:
        with self._lock:
            host_lock = self._host_locks.setdefault(host.conn_id, threading.Lock())
        with host_lock:  # one connection per host; hosts connect in parallel
            client = self._clients.get(host.conn_id)
            transport = client.get_transport() if client else None
            if transport is None or not transport.is_active():
                client = self._connect(host)
                with self._lock:
                    self._clients[host.conn_id] = client
            return client

    def _connect(self, host: RemoteHost) -> Any:
        import paramiko

        try:
            return host.connect()
        except paramiko.BadHostKeyException as error:
            raise HostError(
                f"host {host}: its host key does not match the one the connection names ({error}). If the host "
                "was reinstalled, put its new key in the connection's extra 'host_key' (ssh-keyscan -t ed25519 "
                "-p <port> <host>); otherwise someone may be intercepting the connection.") from None
        except paramiko.SSHException as error:
            if "known_hosts" in str(error) or "host key" in str(error).lower():
                raise HostError(
                    f"host {host}: its host key is unknown ({error}). Add the host's public key to the connection's "
                    "extra as \"host_key\": \"ssh-ed25519 AAAA...\" (from ssh-keyscan -t ed25519 -p <port> <host>), "
                    "or to the known_hosts file of the Airflow worker; host-key checking stays on.") from None
            raise HostError(f"host {host}: SSH failed: {error}. Check the connection's login, key and port.") \
                from None
        except (OSError, EOFError) as error:
            raise HostError(f"host {host} is unreachable: {type(error).__name__}: {error}. Check that the host is "
                            "up, that sshd listens on the connection's port, and the network between them.") \
                from None

    def _open(self, host: RemoteHost, mode: str) -> Any:
        transport = self.client(host).get_transport()
        try:
            channel = transport.open_session(timeout=REQUEST_TIMEOUT_S)
            channel.set_combine_stderr(True)
            channel.exec_command(f"exec {shlex.quote(self.remote_python)} -u -m {AGENT_MODULE} {mode}")
        except Exception as error:  # noqa: BLE001 - paramiko raises SSHException, EOFError or socket errors
            raise HostError(f"host {host}: cannot start the agent over SSH: {type(error).__name__}: {error}. "
                            "The server may limit sessions (raise MaxSessions in sshd_config).") from None
        return channel

    def request(self, host: RemoteHost, mode: str, payload: Mapping[str, Any],
                timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """One agent call that answers with one JSON line."""
        channel = self._open(host, mode)
        try:
            channel.settimeout(timeout_s)
            channel.sendall(json.dumps(payload).encode() + b"\n")
            channel.shutdown_write()
            output = b""
            try:
                while chunk := channel.recv(65536):
                    output += chunk
            except TimeoutError:
                raise HostError(f"host {host}: the agent's {mode} did not answer within {timeout_s:g} s") from None
            status = channel.recv_exit_status()
        finally:
            channel.close()
        last = output.strip().splitlines()[-1] if output.strip() else b""
        try:
            answer = json.loads(last)
        except ValueError:
            hint = ("remote_python does not exist on that host: set remote_python to the worker environment's "
                    "interpreter there" if status == 127 else
                    "is the project installed in remote_python's environment on that host?")
            raise HostError(f"host {host}: `{self.remote_python} -m {AGENT_MODULE} {mode}` exited {status}: "
                            f"{output.decode(errors='replace').strip()[-500:] or 'no output'} ({hint})") from None
        if "error" in answer:
            raise HostError(f"host {host}: agent {mode}: {answer['error']}")
        return answer

    def ask_all(self, hosts: Sequence[RemoteHost], mode: str,
                payload: Mapping[str, Any] | Callable[[RemoteHost], Mapping[str, Any]],
                timeout_s: float = REQUEST_TIMEOUT_S) -> list[dict[str, Any] | HostError]:
        """Every host's answer to one agent call (`payload`, or `payload(host)` for a host's own), or the HostError it
        failed with, asked in parallel (each costs a connection and an agent start: a quarter of a second on
        loopback, more across a network)."""
        def ask(host: RemoteHost) -> dict[str, Any] | HostError:
            try:
                return self.request(host, mode, payload(host) if callable(payload) else payload, timeout_s=timeout_s)
            except HostError as error:
                return error

        with ThreadPoolExecutor(max(1, min(len(hosts), MAX_PARALLEL_REQUESTS)),
                                thread_name_prefix=f"ssh-{mode}") as pool:
            return list(pool.map(ask, hosts))

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
