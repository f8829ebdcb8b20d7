"""Test hosts on their own network stacks: one Linux network namespace per host, joined by a bridge.

Loopback addresses (127.0.0.2, .3, ...) share one network stack: the kernel routes every "host's" traffic over
loopback at memory speed, so a link's bandwidth never matters and a host's own interfaces are never used. Here each
host is a network namespace with its own loopback, one veth interface and one address in a private /24; the other
end of its veth sits on a bridge in the root namespace, which holds the subnet's first address (this process, the
Airflow side, reaches the hosts through it, and the hosts reach services this process starts on it). Optionally
`tc ... tbf` limits every link to a rate, on both ends (tbf shapes only what leaves an interface).

Everything is created under names that carry this process's pid and removed by name on exit, also when the test
fails; a later instance removes what a killed process left (its pid is gone). Each instance takes its own /24 under
a lock file, so concurrent test processes never share a subnet. Needs root and iproute2 (`unavailable_reason`).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Self

# 10.213.40.0/24 .. 10.213.59.0/24: no other test of this project uses 10.213.x.
SUBNET_PREFIX = "10.213"
FIRST_SUBNET, SUBNETS = 40, 20
LOCK_DIR = Path(tempfile.gettempdir()) / "gpt-finetune-netns"
NAME_PREFIX = "gftn"  # every name below starts with it: bridges gftnb<pid>, veths gftnv<pid>h<i>, netns gftn-<pid>-h<i>
_OURS = re.compile(rf"^{NAME_PREFIX}(?:-|b|v|i)(\d+)")
# tbf's bucket must hold at least one GSO super-packet (veth sends ~64 KB) and rate/HZ, or the link loses a third of
# its rate; a short queue (latency) keeps the round trip near the link's own.
MIN_BURST_BYTES = 256 << 10
QUEUE_LATENCY_MS = 10


@functools.cache
def unavailable_reason() -> str | None:
    """Why namespaced hosts cannot be made here (not root, no iproute2, a container without the right), or None:
    a namespace and a bridge are made and removed once to find out."""
    if os.getuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 is not installed (apt-get install -y iproute2; scripts/provision-tests.sh does it as root)"
    namespace, bridge = f"{NAME_PREFIX}-{os.getpid()}-probe", f"{NAME_PREFIX}b{os.getpid()}"
    try:
        for made in (_ip("netns", "add", namespace, check=False), _ip("link", "add", bridge, "type", "bridge",
                                                                        check=False)):
            if made.returncode != 0:
                return f"this machine refuses network namespaces or bridges: {made.stderr.strip()}"
    finally:
        _ip("netns", "delete", namespace, check=False)
        _ip("link", "delete", bridge, check=False)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def _tc(*args: str) -> None:
    result = subprocess.run(["tc", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` failed: {result.stderr.strip()}")


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_leftovers() -> list[str]:
    """Remove the namespaces, bridges and veths of test processes that are gone; returns their names."""
    removed = []
    for name in _ip("netns", "list").stdout.split():
        found = _OURS.match(name)
        if found and not _alive(int(found[1])):
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        found = _OURS.match(name)
        if found and not _alive(int(found[1])):
            _ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class NamespacedHost:
    """One host: its namespace, its address, and the root-side end of its link (taking that down cuts the host off)."""

    index: int
    namespace: str
    address: str
    link: str  # the veth end on the bridge, in the root namespace
    inner_link: str  # the veth end inside the namespace

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's network stack."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def set_link(self, up: bool) -> None:
        """Take this host's link down (as a pulled cable or a failed switch port would) or bring it back."""
        _ip("link", "set", self.link, "up" if up else "down")


class HostNetwork:
    """`count` namespaced hosts on one bridge; a context manager that removes everything it made, by name.

    `rate_mbit` limits each host's link in both directions (None: unlimited, veth speed)."""

    def __init__(self, count: int, *, rate_mbit: float | None = None) -> None:
        self.count, self.rate_mbit = count, rate_mbit
        self.pid = os.getpid()
        self.bridge = f"{NAME_PREFIX}b{self.pid}"
        self.hosts: list[NamespacedHost] = []
        self._lock: contextlib.ExitStack | None = None
        self.subnet = ""

    @property
    def gateway(self) -> str:
        """The bridge's address: how the hosts reach this process (bind test services here, not to 127.0.0.1)."""
        return f"{self.subnet}.1"

    def __enter__(self) -> Self:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot create namespaced test hosts: {reason}")
        remove_leftovers()
        self._lock = contextlib.ExitStack()
        try:
            self.subnet = self._take_subnet()
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for host in self.hosts:
            _ip("netns", "delete", host.namespace, check=False)  # also deletes the veth pair
            _ip("link", "delete", host.link, check=False)
        _ip("link", "delete", self.bridge, check=False)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _take_subnet(self) -> str:
        LOCK_DIR.mkdir(exist_ok=True)
        for third in range(FIRST_SUBNET, FIRST_SUBNET + SUBNETS):
            handle = open(LOCK_DIR / f"{SUBNET_PREFIX}.{third}.lock", "w")  # noqa: SIM115 - held until __exit__
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self._lock.callback(handle.close)
            return f"{SUBNET_PREFIX}.{third}"
        raise RuntimeError(f"all {SUBNETS} test subnets under {SUBNET_PREFIX}.x are in use ({LOCK_DIR})")

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for index in range(self.count):
            host = NamespacedHost(index=index, namespace=f"{NAME_PREFIX}-{self.pid}-h{index}",
                                  address=f"{self.subnet}.{index + 2}", link=f"{NAME_PREFIX}v{self.pid}h{index}",
                                  inner_link=f"{NAME_PREFIX}i{self.pid}h{index}")
            self.hosts.append(host)
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", host.inner_link)
            _ip("link", "set", host.inner_link, "netns", host.namespace)
            _ip("link", "set", host.link, "master", self.bridge)
            _ip("link", "set", host.link, "up")
            inside = ("-n", host.namespace)
            _ip(*inside, "addr", "add", f"{host.address}/24", "dev", host.inner_link)
            _ip(*inside, "link", "set", host.inner_link, "up")
            _ip(*inside, "link", "set", "lo", "up")
            if self.rate_mbit:
                self._limit(host)

    def _limit(self, host: NamespacedHost) -> None:
        rate_bytes_s = self.rate_mbit * 1e6 / 8
        burst = max(MIN_BURST_BYTES, int(rate_bytes_s / 100))  # HZ is 100..1000: rate/100 covers every kernel
        shape = ["root", "tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst),
                 "latency", f"{QUEUE_LATENCY_MS}ms"]
        _tc("qdisc", "add", "dev", host.link, *shape)
        _tc("-n", host.namespace, "qdisc", "add", "dev", host.inner_link, *shape)
