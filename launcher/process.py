"""Processes on this machine: the one stopping ladder (TERM, grace, KILL) and the two ways of finding them (a
process group; markers in each process's environment: the run key, the group's name, a launch's guard token).
Used by the local backend and its guard, the release of a run and, on remote hosts, the SSH agent
(`launcher.agent`): the process table through psutil (in every image), no Airflow, no TensorFlow."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import psutil

from launcher.errors import LaunchError

T = TypeVar("T")
PROC = Path(psutil.PROCFS_PATH)  # the process table psutil reads: a host without it finds no processes
POLL_INTERVAL_S = 0.05
KILL_WAIT_S = 5.0
# A worker whose launcher is gone (killed without running its cleanup: SIGKILL, the OOM killer) gets this long after
# SIGTERM before SIGKILL: nobody waits for its result, a checkpoint it is writing is all worth waiting for (the trainer
# ends right after it), and its GPUs are wanted by the retry.
ORPHAN_GRACE_S = 3.0
# Every worker of one local launch attempt carries `TFMW_GUARD=<token>`: its guard ends them by it
# (launcher.guard, which the package must not import: it runs as `python -m`).
GUARD_ENV = "TFMW_GUARD"
# A process ended by signal n: Popen's return code is -n; a shell, sshd and container runtimes report 128 + n.
SIGNAL_STATUS_BASE = 128
MAX_SIGNAL = 64  # Linux's highest real-time signal


def exit_status_to_code(status: int) -> int:
    """An exit status as a shell, sshd or a container runtime reports it, as a Popen return code: 128 + n for a
    signal n is -n; anything else is unchanged."""
    return SIGNAL_STATUS_BASE - status if SIGNAL_STATUS_BASE < status <= SIGNAL_STATUS_BASE + MAX_SIGNAL else status


def code_to_exit_status(code: int) -> int:
    """A Popen return code as an exit status (the inverse of `exit_status_to_code`): -n is 128 + n."""
    return SIGNAL_STATUS_BASE - code if code < 0 else code


def stop_ladder(targets: Sequence[T], *, terminate: Callable[[T], None], kill: Callable[[T], None],
                gone: Callable[[T], bool], grace_s: float, on_kill: Callable[[T], None] | None = None,
                kill_wait_s: float = KILL_WAIT_S) -> list[T]:
    """Ask every target to stop, give them `grace_s`, then kill the stubborn ones; returns those still alive."""
    alive = [t for t in targets if not gone(t)]
    if not alive:
        return []
    for target in alive:
        terminate(target)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(gone(t) for t in alive):
        time.sleep(POLL_INTERVAL_S)
    stubborn = [t for t in alive if not gone(t)]
    for target in stubborn:
        if on_kill:
            on_kill(target)
        kill(target)
    deadline = time.monotonic() + kill_wait_s
    while time.monotonic() < deadline and not all(gone(t) for t in stubborn):
        time.sleep(POLL_INTERVAL_S)
    return [t for t in stubborn if not gone(t)]


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies.

    Orphans are re-parented to PID 1, which in some containers never reaps them: a zombie has no resources left
    but still counts for `killpg(pgid, 0)`, so the process table is read instead.
    """
    members = []
    for pid in psutil.pids():
        try:  # the group first (one system call): only a member's status is read, as this runs in polling loops
            if os.getpgid(pid) == pgid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.append(pid)
        except (ProcessLookupError, psutil.Error):
            continue  # exited while we looked
    return members


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # already gone (PermissionError: macOS reports a group of zombies this way)


def group_gone(pgid: int) -> bool:
    return not live_group_members(pgid)  # a zombie leader counts as gone: its parent reaps it


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not group_gone(pgid) and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
    return group_gone(pgid)


def stop_group(pgid: int, grace_s: float, first: signal.Signals = signal.SIGTERM) -> None:
    """The launcher's one stopping ladder, for a worker's whole process group: `first` (SIGTERM; ABORT_SIGNAL when
    another rank failed), `grace_s`, SIGKILL."""
    stop_ladder([pgid], terminate=lambda g: signal_group(g, first),
                kill=lambda g: signal_group(g, signal.SIGKILL), gone=group_gone, grace_s=grace_s)


def processes_with_env(markers: Mapping[str, str]) -> dict[int, str]:
    """pid -> command line of every live process (not this one) whose environment has every `name=value` of
    `markers` (the run key alone: all of a run's processes; with the group's name: one task's)."""
    if not markers:
        raise ValueError("processes_with_env needs at least one marker")
    check_process_table()
    found = {}
    for proc in psutil.process_iter(["environ"]):  # unreadable (another user's): None
        environ = proc.info["environ"] or {}
        if proc.pid == os.getpid() or any(environ.get(name) != value for name, value in markers.items()):
            continue
        try:  # only a match's status and command line are read: this runs in the agents' polling loops
            if proc.status() == psutil.STATUS_ZOMBIE:  # a zombie holds nothing; its parent reaps it
                continue
            found[proc.pid] = " ".join(proc.cmdline()).strip()
        except psutil.Error:  # gone since the scan: nothing to find
            continue
    return found


class NoProcessTableError(LaunchError):
    """This host has no /proc to find a run's processes by their environment: nothing is launched here."""


def check_process_table() -> None:
    """NoProcessTableError, naming the host and what to do, when processes cannot be found by their markers."""
    try:
        next(PROC.iterdir(), None)
    except OSError as error:  # FileNotFoundError (no /proc: macOS, a container without it), PermissionError
        raise NoProcessTableError(
            f"Host {socket.gethostname()} has no readable process table at {PROC} ({type(error).__name__}): the "
            "local backend finds a run's processes by the markers in their environment there, to end what an "
            "earlier attempt left and to guard this one, so it launches nothing on this host. Run it on Linux with "
            "/proc mounted, or use backend 'ssh' or 'kubernetes'.") from None


def signal_pids(pids: Iterable[int], sig: signal.Signals) -> list[int]:
    """Send `sig` to each pid; returns those that existed."""
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    return signalled


def end_marked_processes(markers: Mapping[str, str], grace_s: float) -> dict[str, list]:
    """End every process carrying all of `markers` (TERM, grace, KILL): what was found, signalled, and survived."""
    found = processes_with_env(markers)
    terminated = signal_pids(sorted(found), signal.SIGTERM)
    killed: list[int] = []

    def still_alive() -> dict[int, str]:
        return processes_with_env(markers)

    if terminated:
        remaining = _wait_until(still_alive, grace_s)
        killed = signal_pids(sorted(remaining), signal.SIGKILL)
    survivors = sorted(_wait_until(still_alive, KILL_WAIT_S)) if killed else sorted(still_alive())
    return {"found": [{"pid": pid, "cmdline": cmd[:200]} for pid, cmd in sorted(found.items())],
            "terminated": terminated, "killed": killed, "survivors": survivors}


def _wait_until(alive: Callable[[], dict[int, str]], timeout_s: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    left = alive()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = alive()
    return left
