"""Real OpenSSH servers standing in for remote hosts: one Debian `/usr/sbin/sshd` per host, each with its own
generated ed25519 host key and its own directory standing in for that host's disk, and one generated client key
authorized for the current user.

A host is either a network namespace of its own (`tests/support/netns.py`: its own network stack, address and
link, sshd on port 22 of its address; what the tests use where the machine allows) or, without one, a loopback
address (127.0.0.2, 127.0.0.3, ...) on this machine's stack.

Every command run through host N gets `TFMW_HOST_ROOT=<its disk>` and `TMPDIR=<its disk>/tmp` from the server
(`SetEnv`), so an agent and its workers write where that host would. All hosts share this machine's hostname,
process table and Python: what differs is the address, the port, the host key, the disk and, namespaced, the
network stack.
The config follows OpenSSH's own regress setup (`regress/test-exec.sh`): `StrictModes no` (keys live under /tmp),
`UsePAM no`, `-D -e` (never `-d`, which serves one connection), started by absolute path (sshd re-executes itself).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tests.support.netns import HostNetwork, NamespacedHost

SSHD = Path("/usr/sbin/sshd")
PRIVSEP_DIR = Path("/run/sshd")  # sshd running as root refuses to start without it
HOST_ROOT_ENV = "TFMW_HOST_ROOT"
READY_TIMEOUT_S = 10.0
INSTALL_HINT = "apt-get install -y openssh-server (scripts/provision-tests.sh does it when run as root)"


@dataclass(frozen=True)
class SSHHost:
    """One fake remote host and the Airflow SSH connection that reaches it with host-key checking on."""

    index: int
    address: str
    port: int
    host_key: str  # "ssh-ed25519 AAAA...", what a connection's `host_key` extra holds
    root: Path  # this host's "disk"
    key_file: Path
    login: str
    log_file: Path
    process: subprocess.Popen
    network: NamespacedHost | None = None  # its own network stack, or None: a loopback address

    @property
    def conn_id(self) -> str:
        return f"tfmw_ssh_host_{self.index}"

    @property
    def tmpdir(self) -> Path:
        return self.root / "tmp"

    def connection(self, **extra) -> dict:
        """The connection as Airflow's JSON form; `extra` entries override (None removes one)."""
        merged = {"key_file": str(self.key_file), "host_key": self.host_key, "conn_timeout": 5, **extra}
        return {"conn_type": "ssh", "host": self.address, "port": self.port, "login": self.login,
                "extra": {name: value for name, value in merged.items() if value is not None}}

    def connection_env(self, **extra) -> dict[str, str]:
        """`AIRFLOW_CONN_<ID>` for this host: set it and `SSHHook(ssh_conn_id=host.conn_id)` reaches the host."""
        return {f"AIRFLOW_CONN_{self.conn_id.upper()}": json.dumps(self.connection(**extra))}


def unavailable_reason() -> str | None:
    """Why fake SSH hosts cannot run here, or None."""
    if not SSHD.is_file():
        return f"OpenSSH server not installed ({SSHD} is missing): {INSTALL_HINT}"
    if shutil.which("ssh-keygen") is None:
        return f"ssh-keygen not found (package openssh-client): {INSTALL_HINT}"
    if os.getuid() != 0 and not PRIVSEP_DIR.is_dir():
        return f"{PRIVSEP_DIR} is missing and only root can create it: run the tests as root or create it"
    return None


def sshd_version() -> tuple[int, int]:
    banner = subprocess.run([str(SSHD), "-V"], capture_output=True, text=True, check=False)
    found = re.search(r"OpenSSH_(\d+)\.(\d+)", banner.stderr + banner.stdout)
    if not found:
        raise RuntimeError(f"cannot read the OpenSSH version from `{SSHD} -V`: {banner.stderr.strip()!r}")
    return int(found[1]), int(found[2])


def _keygen(path: Path, comment: str) -> str:
    """A new ed25519 key pair (private key mode 0600); returns the public key line without its comment."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


def _server_command(config: Path, network: NamespacedHost | None) -> list[str]:
    """sshd in the foreground (in the host's namespace when it has one), ended by SIGTERM when the test process dies
    (even by SIGKILL or a timeout), so no server outlives the session: util-linux's `setpriv --pdeathsig` sets that,
    then executes `ip netns exec`, which executes sshd."""
    sshd = [str(SSHD), "-D", "-e", "-f", str(config)]
    if network is not None:
        sshd = network.command(sshd)
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *sshd] if setpriv else sshd


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def _config(host_dir: Path, root: Path, address: str, port: int, authorized_keys: Path) -> str:
    lines = [
        f"ListenAddress {address}:{port}",
        f"HostKey {host_dir / 'ssh_host_ed25519_key'}",
        f"PidFile {host_dir / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized_keys}",
        "StrictModes no",
        "UsePAM no",
        "AuthenticationMethods publickey",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        # A dead client is noticed within 15 s, so sshd closes the agent's stdin and the agent stops its worker.
        "ClientAliveInterval 5",
        "ClientAliveCountMax 3",
        "MaxSessions 32",  # one channel per rank plus probes and kills over one connection
        "MaxStartups 64:30:128",  # tests connect to every host at once
        "LoginGraceTime 20",
        "PrintMotd no",
        "PrintLastLog no",
        "LogLevel VERBOSE",
        f'SetEnv "{HOST_ROOT_ENV}={root}" "TMPDIR={root / "tmp"}"'
        # The agent imports the code under test (a worktree first on PYTHONPATH), not only the installed project.
        + (f' "PYTHONPATH={os.environ["PYTHONPATH"]}"' if os.environ.get("PYTHONPATH") else ""),
    ]
    if sshd_version() >= (9, 8):
        lines.append("PerSourcePenalties no")  # failed-auth tests would otherwise lock the client address out
    return "\n".join(lines) + "\n"


def _accepts_ssh(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1) as sock:
            return sock.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _start_one(index: int, base: Path, authorized_keys: Path, key_file: Path,
               network: NamespacedHost | None) -> SSHHost:
    address = network.address if network else f"127.0.0.{index + 1}"
    host_dir = base / f"host-{index}"
    root = host_dir / "disk"
    (root / "tmp").mkdir(parents=True)
    host_key = _keygen(host_dir / "ssh_host_ed25519_key", f"tfmw-test-host-{index}")
    log_file = host_dir / "sshd.log"
    for _ in range(3):  # the free port can be taken before sshd binds it
        port = 22 if network else _free_port(address)  # a host of its own serves SSH where a real one does
        config = host_dir / "sshd_config"
        config.write_text(_config(host_dir, root, address, port, authorized_keys))
        with log_file.open("ab") as log:
            process = subprocess.Popen(_server_command(config, network), stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            if _accepts_ssh(address, port):
                return SSHHost(index, address, port, host_key, root, key_file, getpass.getuser(), log_file, process,
                               network)
            time.sleep(0.05)
        _stop_listener(process)
    raise RuntimeError(f"sshd for fake host {index} ({address}) did not accept connections within "
                       f"{READY_TIMEOUT_S:.0f} s; its log {log_file}:\n{log_file.read_text()[-2000:]}")


def start_hosts(count: int, base: Path, network: HostNetwork | None = None) -> list[SSHHost]:
    """Start `count` fake hosts under `base` (one directory each), on the namespaced hosts of `network` when given
    (it has at least `count`), else on loopback addresses; stop them with `stop_hosts`."""
    if os.getuid() == 0:
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    key_file = base / "client_ed25519"
    authorized_keys = base / "authorized_keys"
    authorized_keys.write_text(_keygen(key_file, "tfmw-test-client") + "\n")
    hosts: list[SSHHost] = []
    try:
        for index in range(1, count + 1):
            hosts.append(_start_one(index, base, authorized_keys, key_file,
                                    network.hosts[index - 1] if network else None))
    except BaseException:
        stop_hosts(hosts)
        raise
    return hosts


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        tree.setdefault(int(text[text.rindex(")") + 2:].split()[1]), []).append(int(stat.parent.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _started_through(roots: list[Path]) -> list[int]:
    """Processes whose environment names one of these host roots: every command run through a fake host."""
    markers = {f"{HOST_ROOT_ENV}={root}".encode() for root in roots}
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if markers & set(environ.read_bytes().split(b"\0")):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def _stop_listener(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop_hosts(hosts: list[SSHHost]) -> None:
    """Stop the servers, their per-connection children and anything still running that was started through them."""
    leftovers = _started_through([host.root for host in hosts])
    for host in hosts:
        leftovers += _descendants(host.process.pid)
        _stop_listener(host.process)
    _kill_all(leftovers)


def take_down(host: SSHHost) -> None:
    """The host is lost: its server stops listening, its connections drop and everything it ran is killed, as when
    a machine loses power. `bring_back` starts it again on the same address, port and host key."""
    victims = _started_through([host.root]) + _descendants(host.process.pid)
    _stop_listener(host.process)
    _kill_all(victims)


def bring_back(host: SSHHost) -> SSHHost:
    """The host after `take_down`, serving again with the same configuration; returns it with its new server."""
    config = host.root.parent / "sshd_config"
    with host.log_file.open("ab") as log:
        process = subprocess.Popen(_server_command(config, host.network), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while process.poll() is None and time.monotonic() < deadline:
        if _accepts_ssh(host.address, host.port):
            return replace(host, process=process)
        time.sleep(0.05)
    _stop_listener(process)
    raise RuntimeError(f"sshd for fake host {host.index} did not come back on {host.address}:{host.port}; its log "
                       f"{host.log_file}:\n{host.log_file.read_text()[-2000:]}")
