"""This host's process table as the launcher and release see it: the processes of a run (found by `TFMW_RUN_KEY`
in their environment), the live members of a process group, the one stopping ladder (SIGTERM, a grace period,
SIGKILL) and the NVML view of GPUs. Standard library plus an optional `pynvml`: the remote agent imports this on
every host, so it must load fast and never import Airflow or TensorFlow.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainer.runtime import RUN_KEY_ENV

PROC = Path("/proc")


def _state_and_pgid(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) of a process, None once it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses, so split after the last ')'.
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


def _pids() -> Iterable[int]:
    return (int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit())


def carries_run_key(pid: int, key: str) -> bool:
    """Whether the process started with `TFMW_RUN_KEY=<key>` in its environment."""
    try:
        return f"{RUN_KEY_ENV}={key}".encode() in (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def command_line(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def processes_of_run(key: str) -> dict[int, str]:
    """pid -> command line of every live process (zombies hold nothing) whose environment carries this run's key,
    except the caller."""
    found = {}
    for pid in _pids():
        if pid == os.getpid() or not carries_run_key(pid, key):
            continue
        status = _state_and_pgid(pid)
        if status is not None and status[0] != "Z":
            found[pid] = command_line(pid)
    return found


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies.

    Orphans are re-parented to PID 1, which in some containers never reaps them: a zombie has no resources left
    but still counts for `killpg(pgid, 0)`, so on Linux the process table is read instead.
    """
    if not PROC.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for pid in _pids():
        status = _state_and_pgid(pid)
        if status is not None and status[1] == pgid and status[0] != "Z":
            members.append(pid)
    return members


def signal_group(pgid: int, signum: int) -> bool:
    """Signal a whole process group; False when it is already gone."""
    try:
        os.killpg(pgid, signum)
        return True
    except (ProcessLookupError, PermissionError):  # PermissionError: macOS reports a group of zombies this way
        return False


def signal_pids(pids: Iterable[int], signum: int) -> list[int]:
    """Signal each pid; returns those that still existed."""
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    return signalled


def wait_until(done: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll `done` until it is true or `timeout_s` passed; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def stop_group(pgid: int, grace_s: float) -> dict[str, bool]:
    """The stopping ladder for a process group: SIGTERM, up to `grace_s` for every member to exit, then SIGKILL
    and up to 5 s more. Returns which rungs were needed."""
    def gone() -> bool:
        return not live_group_members(pgid)  # a zombie leader counts as gone: its parent reaps it

    if gone():
        return {"terminated": False, "killed": False}
    signal_group(pgid, signal.SIGTERM)
    if wait_until(gone, grace_s):
        return {"terminated": True, "killed": False}
    signal_group(pgid, signal.SIGKILL)
    wait_until(gone, 5.0)
    return {"terminated": True, "killed": True}


def stop_run(key: str, grace_s: float) -> dict[str, Any]:
    """The stopping ladder for every process of a run on this host (release): SIGTERM all, wait up to `grace_s`,
    SIGKILL what is left, then report who survived 5 s more."""
    alive = processes_of_run(key)
    outcome: dict[str, Any] = {"found": [{"pid": pid, "cmdline": cmd[:200]} for pid, cmd in sorted(alive.items())],
                               "terminated": [], "killed": [], "survivors": []}
    if alive:
        outcome["terminated"] = signal_pids(sorted(alive), signal.SIGTERM)
        wait_until(lambda: not processes_of_run(key), grace_s, interval_s=0.2)
        outcome["killed"] = signal_pids(sorted(processes_of_run(key)), signal.SIGKILL)
        wait_until(lambda: not processes_of_run(key), 5.0, interval_s=0.2)
        outcome["survivors"] = sorted(processes_of_run(key))
    return outcome


def _nvml():
    """The initialised `pynvml` module, or the reason there is none (no library, no driver: a CPU host)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as exc:  # noqa: BLE001 - NVMLError, ImportError, OSError: all mean "no GPU to see"
        return f"no NVML ({type(exc).__name__})"


def gpu_inventory() -> dict[str, Any]:
    """What NVML sees: {"nvml": True, "count", "free": indices (PCI bus order) with no compute process}, or
    {"nvml": False, "count": 0, "free": [], "note"} without a library or driver."""
    nvml = _nvml()
    if isinstance(nvml, str):
        return {"nvml": False, "count": 0, "free": [], "note": nvml}
    try:
        count = nvml.nvmlDeviceGetCount()
        free = [index for index in range(count)
                if not nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(index))]
        return {"nvml": True, "count": count, "free": free}
    finally:
        nvml.nvmlShutdown()


def free_gpus() -> list[int]:
    """Indices of GPUs with no compute process; [] without NVML."""
    return gpu_inventory()["free"]


def gpu_check(run_pids: set[int]) -> dict[str, Any]:
    """Which GPU processes remain, and whether any belongs to this run (NVML); on CPU there is nothing to check."""
    nvml = _nvml()
    if isinstance(nvml, str):
        return {"nvml": False, "note": f"{nvml}: no GPU to verify on this host"}
    try:
        devices = []
        held = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            procs = [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            held += [{"gpu": index, "pid": pid} for pid in procs if pid in run_pids]
            devices.append({"gpu": index, "used_mb": memory.used // 2**20, "pids": procs})
        return {"nvml": True, "devices": devices, "held_by_run": held}
    finally:
        nvml.nvmlShutdown()
