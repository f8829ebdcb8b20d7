"""Which machine, boot and container a process runs in: what a local state record says about its launcher, and what
release compares it with before it calls anything released.

The local backend's release sees only its own host: its `/proc` (processes of the same PID namespace), its `/tmp`
(the same mount namespace) and its GPUs (the same kernel). A record written by a launcher elsewhere cannot be checked
there, so the record names its launcher's identity: the hostname (a container's own by default), the kernel's boot
id (another machine, or a reboot, has another), and the PID and mount namespaces (another container on the same
machine has its own). Two identities are the same only when all four match. Standard library only.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

BOOT_ID = "/proc/sys/kernel/random/boot_id"
FIELDS = ("hostname", "boot_id", "pid_namespace", "mount_namespace")


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def _namespace(kind: str) -> str:
    """The namespace's inode, as `/proc/self/ns/<kind>` links it ("pid:[4026531836]"); "" where unreadable."""
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def host_identity() -> dict[str, str]:
    """This process's host identity (the four FIELDS; "" for a part this system does not expose)."""
    return {"hostname": socket.gethostname(), "boot_id": _read(BOOT_ID), "pid_namespace": _namespace("pid"),
            "mount_namespace": _namespace("mnt")}


def same_host(recorded: Any, here: Mapping[str, str]) -> bool:
    """Whether a recorded identity is this one: every field present and equal (a record without one is not)."""
    return (isinstance(recorded, Mapping) and bool(recorded.get("hostname"))
            and all(recorded.get(name) == here.get(name) for name in FIELDS))


def describe(identity: Any) -> str:
    """"gpu-host-1 (boot d356cf5d, pid:[4026531836], mnt:[4026531832])" for messages; what a record lacks, said."""
    if not isinstance(identity, Mapping) or not identity.get("hostname"):
        return "an unknown host (the record names no launcher host: written by an older version?)"
    boot = str(identity.get("boot_id") or "?")[:8]
    return (f"{identity['hostname']} (boot {boot}, {identity.get('pid_namespace') or 'pid:?'}, "
            f"{identity.get('mount_namespace') or 'mnt:?'})")
