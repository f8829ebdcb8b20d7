"""The remote agent through real OpenSSH servers (tests/support/sshd.py) and the Airflow SSH provider's own `SSHHook`,
with host-key checking on: what the SSH backend stands on. Each case prints what it measured."""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import uuid
from importlib import metadata
from pathlib import Path

import paramiko
import pytest
from airflow.providers.ssh.hooks.ssh import SSHHook

from launcher.host_probe import VERSIONED_PACKAGES
from launcher.process import live_group_members
from tests.launcher.conftest import ENTRYPOINTS, alive

REMOTE_PYTHON = sys.executable  # the fake hosts share this machine's worker environment
WORKER = [REMOTE_PYTHON, "-u", str(ENTRYPOINTS / "agent_worker.py")]
GRACE_S = 0.5


def _hook(monkeypatch, host, **extra) -> SSHHook:
    """The provider's hook for `host`'s connection, registered by environment variable as a deployment would."""
    for name, value in host.connection_env(**extra).items():
        monkeypatch.setenv(name, value)
    return SSHHook(ssh_conn_id=host.conn_id, conn_retry_attempts=1)


def _agent(client: paramiko.SSHClient, mode: str) -> paramiko.Channel:
    channel = client.get_transport().open_session()
    channel.settimeout(30)
    channel.exec_command(f"exec {shlex.quote(REMOTE_PYTHON)} -u -m launcher.agent {mode}")
    return channel


def _ask(client: paramiko.SSHClient, mode: str, request: dict) -> dict:
    channel = _agent(client, mode)
    channel.sendall(json.dumps(request).encode() + b"\n")
    channel.shutdown_write()
    answer, errors = channel.makefile("rb").read(), channel.makefile_stderr("rb").read()
    assert channel.recv_exit_status() == 0, errors.decode()
    return json.loads(answer)



def test_the_hook_reaches_every_host_with_its_host_key_and_the_agent_probes_it(ssh_hosts, monkeypatch):
    for host in ssh_hosts:
        hook = _hook(monkeypatch, host)
        assert hook.no_host_key_check is False
        assert f"{hook.host_key.get_name()} {hook.host_key.get_base64()}" == host.host_key
        started = time.monotonic()
        client = hook.get_conn()
        connected = time.monotonic()
        try:
            answer = _ask(client, "probe", {"ports": 3, "workdir": str(host.root / "tfmw"),
                                            "use_gpu": False})
        finally:
            client.close()
        print(f"\n{host.address}:{host.port}: connect {connected - started:.3f} s, "
              f"probe {time.monotonic() - connected:.3f} s: {answer}")
        assert answer["host"] == socket.gethostname()
        assert answer["python"] == "{}.{}.{}".format(*sys.version_info[:3])
        assert answer["versions"] == {name: metadata.version(name) for name in VERSIONED_PACKAGES}
        assert answer["tmpdir"] == str(host.tmpdir), "the server's SetEnv must reach the command"
        assert len(set(answer["free_ports"])) == 3
        assert answer["workdir_writable"] and (host.root / "tfmw").is_dir()


def test_a_wrong_or_missing_host_key_is_refused(ssh_hosts, monkeypatch):
    first, second = ssh_hosts
    with pytest.raises(paramiko.BadHostKeyException) as wrong:
        _hook(monkeypatch, first, host_key=second.host_key).get_conn()
    print(f"\nwrong host key: {type(wrong.value).__module__}.{type(wrong.value).__name__}: {wrong.value}")
    assert wrong.value.hostname == first.address  # paramiko names the host without the port here
    assert wrong.value.key.get_base64() == first.host_key.split()[1]

    with pytest.raises(paramiko.SSHException) as missing:
        _hook(monkeypatch, first, host_key=None).get_conn()
    print(f"no host key: {type(missing.value).__module__}.{type(missing.value).__name__}: {missing.value}")
    assert type(missing.value) is paramiko.SSHException
    known_as = first.address if first.port == 22 else f"[{first.address}]:{first.port}"  # OpenSSH's known_hosts form
    assert str(missing.value) == f"Server '{known_as}' not found in known_hosts"


def test_an_unreachable_or_silent_host_fails_in_seconds(ssh_hosts, monkeypatch):
    host = ssh_hosts[0]
    with socket.socket() as probe:
        probe.bind(("127.0.0.9", 0))
        closed_port = probe.getsockname()[1]  # nothing listens there once this socket is closed
    hook = _hook(monkeypatch, host)
    hook.remote_host, hook.port = "127.0.0.9", closed_port
    started = time.monotonic()
    with pytest.raises(paramiko.ssh_exception.NoValidConnectionsError) as refused:
        hook.get_conn()
    refused_s = time.monotonic() - started
    print(f"\nnothing listening: {type(refused.value).__name__}: {refused.value} after {refused_s:.2f} s")

    # A host that accepts TCP but never speaks SSH (hung sshd, wrong service): only `banner_timeout` bounds it.
    with socket.create_server(("127.0.0.9", 0)) as silent:
        hook = SSHHook(ssh_conn_id=host.conn_id, conn_retry_attempts=1, banner_timeout=2)
        hook.remote_host, hook.port = "127.0.0.9", silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(paramiko.SSHException) as mute:
            hook.get_conn()
        mute_s = time.monotonic() - started
    print(f"silent listener: {type(mute.value).__name__}: {mute.value} after {mute_s:.2f} s")
    assert "banner" in str(mute.value)
    assert refused_s < 5 and mute_s < 10


def _start_worker(client: paramiko.SSHClient, host, secret: str) -> tuple[paramiko.Channel, list[str], int, int]:
    """A stubborn worker (ignores SIGTERM, has a child that ignores it too) under a `run` agent on the host."""
    channel = _agent(client, "run")
    channel.set_combine_stderr(True)
    request = {"argv": WORKER, "cwd": str(host.root / "run" / "rank-0"), "grace_s": GRACE_S, "base_env": "inherit",
               "env": {"AGENT_WORKER_SHOW": "TFMW_HOST_ROOT,TMPDIR,TFMW_HOST_TMPDIR", "TFMW_SECRET": secret}}
    channel.sendall(json.dumps(request).encode() + b"\n")
    output = channel.makefile("rb")
    lines = [output.readline().decode().rstrip("\n") for _ in range(3)]
    assert lines[0].startswith("TFMW_AGENT "), lines
    worker, child = map(int, lines[2].removeprefix("pids ").split())
    return channel, lines, worker, child


def _command_lines_holding(text: str) -> list[int]:
    """Pids whose command line holds `text` (on the fake hosts too: they share this process table)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def _seconds_until_gone(worker: int, child: int) -> float:
    started = time.monotonic()
    while alive(worker) or alive(child) or live_group_members(worker):
        assert time.monotonic() - started < 15, f"worker {worker} or its child {child} alive 15 s after the stop"
        time.sleep(0.05)
    return time.monotonic() - started


def test_closing_the_channel_ends_the_remote_worker_and_no_secret_is_in_any_argv(ssh_hosts, monkeypatch):
    host = ssh_hosts[0]
    secret = f"secret-{uuid.uuid4().hex}"
    client = _hook(monkeypatch, host).get_conn()
    try:
        channel, lines, worker, child = _start_worker(client, host, secret)
        assert json.loads(lines[1].removeprefix("env ")) == {"TFMW_HOST_ROOT": str(host.root),
                                                             "TMPDIR": str(host.root / "run" / "rank-0" / "tmp"),
                                                             "TFMW_HOST_TMPDIR": str(host.tmpdir)}
        assert Path(f"/proc/{worker}/cwd").resolve() == host.root / "run" / "rank-0"
        assert _command_lines_holding(secret) == []
        channel.close()
        gone_s = _seconds_until_gone(worker, child)
    finally:
        client.close()
    print(f"\nchannel closed: stubborn worker and child gone after {gone_s:.2f} s (grace {GRACE_S} s)")


def test_eof_on_the_channel_stops_the_worker_and_its_exit_still_arrives(ssh_hosts, monkeypatch):
    """Sending EOF (not closing) is the gentle stop: the agent runs the ladder and the output keeps flowing."""
    host = ssh_hosts[0]
    client = _hook(monkeypatch, host).get_conn()
    try:
        channel, _, worker, child = _start_worker(client, host, "unused")
        channel.shutdown_write()
        rest = channel.makefile("rb").read().decode().splitlines()
        status = channel.recv_exit_status()
    finally:
        client.close()
    print(f"\nEOF sent: the agent relayed {rest} and exited {status}")
    assert "TERM ignored" in rest
    assert rest[-1] == 'TFMW_EXIT {"code": -9}' and status == 128 + 9
    assert _seconds_until_gone(worker, child) < 1


def test_a_dropped_connection_ends_the_remote_worker(ssh_hosts, monkeypatch):
    host = ssh_hosts[1]
    client = _hook(monkeypatch, host).get_conn()
    try:
        _, _, worker, child = _start_worker(client, host, "unused")
        transport = client.get_transport()
        transport.sock.shutdown(socket.SHUT_RDWR)  # the connection drops: no SSH close, no disconnect message
        transport.sock.close()
        gone_s = _seconds_until_gone(worker, child)
    finally:
        client.close()
    print(f"\nconnection dropped: stubborn worker and child gone after {gone_s:.2f} s (grace {GRACE_S} s)")


def test_each_host_has_a_network_stack_of_its_own_where_the_machine_allows(ssh_hosts):
    from tests.support import netns

    reason = netns.unavailable_reason()
    if reason:
        pytest.skip(f"the hosts are loopback addresses here: {reason}")
    ours = os.readlink("/proc/self/ns/net")
    stacks = {os.readlink(f"/proc/{host.process.pid}/ns/net") for host in ssh_hosts}  # each host's sshd
    assert len(stacks) == len(ssh_hosts) and ours not in stacks
    assert all(host.port == 22 and not host.address.startswith("127.") for host in ssh_hosts)
