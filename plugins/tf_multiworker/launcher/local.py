"""Local backend: each worker is a process on this machine, in its own session (so its whole process group can
be stopped), with one GPU when asked for. TF_CONFIG names loopback addresses, but TensorFlow's worker server
listens on every interface (see the README's Security model), and the worker's environment is the allow-listed
part of this process's (`trainer.runtime.inherited_environment`)."""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, ClassVar

from tf_multiworker.launcher.backend import Backend, WorkerHandle
from tf_multiworker.launcher.errors import InsufficientGPUsError
from tf_multiworker.launcher.spec import Placement, WorkerSpec
from trainer.runtime import inherited_environment

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


class PortAllocator:
    """Hands out ports the kernel reports free, never the same one twice in this process for a while.

    A port can still be taken by another process between this check and the worker's bind: the group runner
    detects the worker's bind failure and relaunches on new ports (bounded by `max_launch_attempts`).
    """

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _recent: ClassVar[collections.deque[int]] = collections.deque(maxlen=4096)

    def __init__(self, host: str = LOOPBACK) -> None:
        self.host = host

    def allocate(self, count: int) -> list[int]:
        with self._lock:
            held: list[socket.socket] = []
            ports: list[int] = []
            try:
                while len(ports) < count:
                    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    sock.bind((self.host, 0))
                    held.append(sock)  # held open until all are chosen, so the kernel cannot repeat one
                    port = sock.getsockname()[1]
                    if port not in self._recent:
                        ports.append(port)
            finally:
                for sock in held:
                    sock.close()
            self._recent.extend(ports)
            return ports


def free_gpus() -> list[int]:
    """Indices (PCI bus order, as NVML numbers them) of GPUs with no compute process; [] without NVML."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("NVML unavailable (%s): no GPUs visible", exc)
        return []
    try:
        free = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if not pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                free.append(index)
        return free
    finally:
        pynvml.nvmlShutdown()


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies.

    Orphans are re-parented to PID 1, which in some containers never reaps them: a zombie has no resources left
    but still counts for `killpg(pgid, 0)`, so on Linux the process table is read instead.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses, so split after the last ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class LocalWorkerHandle(WorkerHandle):
    def __init__(self, rank: int, host: str, process: subprocess.Popen) -> None:
        self.rank = rank
        self.host = host
        self.process = process
        self.pid = process.pid
        self.pgid = process.pid  # start_new_session: the worker leads its own process group

    @property
    def output(self) -> IO[bytes]:
        return self.process.stdout

    def poll(self) -> int | None:
        return self.process.poll()

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # already gone (PermissionError: macOS reports a group of zombies this way)

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def gone(self) -> bool:
        if self.process.poll() is None:
            return False
        return not live_group_members(self.pgid)  # children the worker left behind keep the group alive


class LocalBackend(Backend):
    name = "local"

    def __init__(self, *, gpu_probe: Callable[[], list[int]] = free_gpus, ports: PortAllocator | None = None):
        self.gpu_probe = gpu_probe
        self.ports = ports or PortAllocator()

    def place(self, num_workers: int, use_gpu: bool) -> list[Placement]:
        devices: list[tuple[int, ...]] = [() for _ in range(num_workers)]
        if use_gpu:
            free = self.gpu_probe()
            if num_workers > len(free):
                raise InsufficientGPUsError(
                    f"use_gpu is on and num_workers={num_workers} needs one GPU per worker, but this machine has "
                    f"{len(free)} free GPU(s) {free} (NVML; GPUs running other processes are not free). "
                    f"Lower num_workers to {len(free)} or less, free the GPUs, or set use_gpu to false."
                    if free else
                    f"use_gpu is on but NVML finds no free GPU on this machine (num_workers={num_workers}). "
                    "Set use_gpu to false to run on CPU, or run on a machine with GPUs and the NVIDIA driver."
                )
            devices = [(gpu,) for gpu in free[:num_workers]]
        ports = self.ports.allocate(num_workers)
        return [Placement(LOOPBACK, port, dev) for port, dev in zip(ports, devices)]

    def start(self, spec: WorkerSpec, command: list[str], env: Mapping[str, str]) -> LocalWorkerHandle:
        process = subprocess.Popen(
            command,
            cwd=spec.workdir,
            env={**inherited_environment(os.environ), **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return LocalWorkerHandle(spec.rank, spec.host, process)
