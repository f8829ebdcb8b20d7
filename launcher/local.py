"""Local backend: each worker is a process on this machine, in its own session (so its whole process group can
be stopped), with one GPU when asked for. TF_CONFIG names loopback addresses, but TensorFlow's worker server
listens on every interface (see docs/security.md), and the worker's environment is the allow-listed
part of this process's (`core.protocol.inherited_environment`). A guard process per launch attempt
(`launcher.guard`) ends the attempt's workers when this process dies without stopping them."""

from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar

from core.protocol import ABORT_SIGNAL, GROUP_ENV, LAUNCHER_WORKDIR_PREFIX, RUN_KEY_ENV, inherited_environment
from launcher.backend import RELEASE_GRACE_S, Backend, Capacity, HostRelease, ReleaseResult, WorkerHandle
from launcher.errors import InsufficientGPUsError, LaunchError
from launcher.gpu_memory import idle_levels_mb
from launcher.gpus import (
    GPU_POLL_S,
    GPU_RELEASE_WAIT_S,
    GpuInventory,
    Polling,
    check_exited_slots,
    gpu_utilization,
    probe_gpus,
    release_check,
    release_is_clean,
    watch_release,
)
from launcher.process import (
    GUARD_ENV,
    KILL_WAIT_S,
    ORPHAN_GRACE_S,
    check_process_table,
    end_marked_processes,
    live_group_members,
    processes_with_env,
    signal_group,
)
from launcher.spec import GroupSpec, Placement, WorkerOutcome, WorkerSpec
from launcher.state_record import StateRecord
from launcher.tf_env import worker_temp_environment

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Caps the workers this machine may start in an elastic launch (tests, or operators who keep cores free).
LOCAL_USABLE_WORKERS_ENV = "TFMW_LOCAL_USABLE_WORKERS"


class PortAllocator:
    """Hands out ports the kernel reports free on `host`, never the same one twice in this process for a while.
    The local backend asks on loopback; the SSH agent on every interface ("0.0.0.0"), where TensorFlow binds.

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


def is_launcher_workdir(path: str) -> bool:
    """Only the launcher's own temporary directories may be deleted: a path read from storage proves nothing."""
    candidate = Path(path)
    try:
        owned = candidate.lstat().st_uid == os.getuid() and not candidate.is_symlink() and candidate.is_dir()
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    return (owned and candidate.name.startswith(LAUNCHER_WORKDIR_PREFIX)
            and candidate.resolve().parent == Path(tempfile.gettempdir()).resolve())


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

    def terminate(self) -> None:
        signal_group(self.pgid, signal.SIGTERM)

    def abort(self) -> None:
        signal_group(self.pgid, ABORT_SIGNAL)

    def kill(self) -> None:
        signal_group(self.pgid, signal.SIGKILL)

    def gone(self) -> bool:
        if self.process.poll() is None:
            return False
        return not live_group_members(self.pgid)  # children the worker left behind keep the group alive

    def record(self) -> dict[str, Any]:
        return {"pid": self.pid, "pgid": self.pgid}


@dataclass
class _Guard:
    """A running guard: its process (stdin is the pipe whose closing it waits for) and the token it ends."""

    process: subprocess.Popen
    token: str

    @classmethod
    def start(cls, group: GroupSpec, log_path: Path) -> _Guard:
        check_process_table()  # the guard finds the workers in it: without one, no worker starts unguarded
        token = f"{group.name}-{uuid.uuid4().hex[:12]}"
        grace_s = min(group.grace_period_s, ORPHAN_GRACE_S)
        with open(log_path, "ab") as guard_log:
            # A session of its own: Airflow's supervisor kills the task runner's process group, and the guard must
            # outlive it. No inherited stdout/stderr: they are the task's sockets to its supervisor, which would wait
            # for the guard to close them.
            process = subprocess.Popen(
                [sys.executable, "-m", "launcher.guard", token, f"{grace_s:g}"],
                env=inherited_environment(os.environ), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=guard_log, start_new_session=True)
        return cls(process, token)

    def close(self) -> None:
        """The attempt ended normally: close the pipe; the guard ends what escaped the workers' groups, then exits."""
        self.process.stdin.close()
        try:
            self.process.wait(ORPHAN_GRACE_S + KILL_WAIT_S + 5)
        except subprocess.TimeoutExpired:
            log.warning("guard %s (pid %d) still running after the attempt ended", self.token, self.process.pid)


class LocalBackend(Backend):
    name = "local"

    def __init__(self, *, gpu_probe: Callable[[], GpuInventory] = probe_gpus, ports: PortAllocator | None = None,
                 environ: Mapping[str, str] = os.environ, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.gpu_probe = gpu_probe
        self.ports = ports or PortAllocator()
        self.environ = environ
        self.clock, self.sleep = clock, sleep
        self._guards: dict[str, _Guard] = {}  # group name -> the guard of its current attempt
        # Until then the GPU probe is repeated while too few GPUs are free: this backend just stopped workers that may
        # still hold some (a relaunch, an earlier attempt's orphans; NVML lists them for 0.09-0.12 s after they die).
        self._gpus_settle_until = 0.0

    def capacity(self, group: GroupSpec) -> Capacity:
        """The cap `TFMW_LOCAL_USABLE_WORKERS` and, with `use_gpu`, this machine's free GPUs."""
        workers, reasons = group.num_workers, []
        raw = self.environ.get(LOCAL_USABLE_WORKERS_ENV, "").strip()
        if raw:
            if not raw.isdigit():
                raise LaunchError(
                    f"{LOCAL_USABLE_WORKERS_ENV}={raw!r} is not a whole number of workers: fix or unset it.")
            if int(raw) < workers:
                workers = int(raw)
                reasons.append(f"this machine allows {workers} worker(s) ({LOCAL_USABLE_WORKERS_ENV}={raw})")
        if group.use_gpu:
            gpus = self._gpus(workers)
            if len(gpus.free) < workers:
                workers = len(gpus.free)
                reasons.append(f"this machine has {len(gpus.free)} free GPU(s) {gpus.free_indices}"
                               + (f" (NVML unavailable: {gpus.unavailable})" if gpus.unavailable else "")
                               + (f" (left out: {gpus.describe_left_out()})" if gpus.left_out else ""))
        return Capacity(workers, tuple(reasons))

    def place(self, group: GroupSpec) -> list[Placement]:
        num_workers = group.num_workers
        devices: list[tuple[int | str, ...]] = [() for _ in range(num_workers)]
        where: list[dict[str, str]] = [{} for _ in range(num_workers)]
        idle: list[dict[str, int]] = [{} for _ in range(num_workers)]
        if group.use_gpu:
            gpus = self._gpus(num_workers)
            if num_workers > len(gpus.free):
                raise InsufficientGPUsError(_too_few_gpus(gpus, num_workers))
            # By UUID: NVML does not promise that its index is CUDA's (NVML reference, nvmlDeviceGetHandleByIndex).
            devices = [(gpu.uuid or gpu.index,) for gpu in gpus.free[:num_workers]]
            where = [{"gpu": str(gpu.index)} for gpu in gpus.free[:num_workers]]
            # A free GPU lists no process: what it reads now is its idle level, which release waits for.
            idle = [{str(gpu.uuid or gpu.index): gpu.idle_mb} if gpu.idle_mb is not None else {}
                    for gpu in gpus.free[:num_workers]]
        ports = self.ports.allocate(num_workers)
        return [Placement(LOOPBACK, *fields) for fields in zip(ports, devices, where, idle)]

    def _gpus(self, wanted: int) -> GpuInventory:
        """The GPU probe; polled, bounded, while fewer than `wanted` are free right after this backend stopped
        workers (review section 5: a relaunch probed GPUs its stopped ranks still held)."""
        gpus = self.gpu_probe()
        while len(gpus.free) < wanted and not gpus.unavailable and self.clock() < self._gpus_settle_until:
            self.sleep(GPU_POLL_S)
            gpus = self.gpu_probe()
        return gpus

    def command(self, group: GroupSpec) -> list[str]:
        return [sys.executable, "-u", "-m", group.entrypoint, *group.args]

    def start(self, group: GroupSpec, worker: WorkerSpec, command: list[str],
              env: Mapping[str, str]) -> LocalWorkerHandle:
        guard = self._guards.get(group.name)
        if guard is None:  # before the attempt's first worker: no worker ever runs unguarded
            # What it ended goes next to the ranks' directories, in the launcher's work directory.
            guard = self._guards[group.name] = _Guard.start(group, Path(worker.workdir).parent / "guard.log")
        process = subprocess.Popen(
            command,
            cwd=worker.workdir,
            env={**inherited_environment(os.environ), **env, **group.secret_env,
                 **worker_temp_environment(worker.workdir), GUARD_ENV: guard.token},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return LocalWorkerHandle(worker.rank, worker.host, process)

    def end_group(self, group: GroupSpec) -> None:
        self._gpus_settle_until = self.clock() + GPU_RELEASE_WAIT_S  # its ranks were just stopped
        guard = self._guards.pop(group.name, None)
        if guard is not None:
            guard.close()

    def check_slots_free(self, group: GroupSpec, workers: Sequence[WorkerOutcome]) -> dict[str, Any]:
        """Each rank's process group gone and, with GPUs, the bounded NVML check release uses (launcher/gpus.py)."""
        pgids = [w.record["pgid"] for w in workers if isinstance(w.record.get("pgid"), int)]
        return check_exited_slots({w.pid for w in workers if w.pid}, [d for w in workers for d in (w.devices or ())],
                                  use_gpu=group.use_gpu, alive=lambda: [p for p in pgids if live_group_members(p)],
                                  idle_mb={name: mb for w in workers for name, mb in w.gpu_idle_mb.items()},
                                  environ=self.environ, polling=Polling(clock=self.clock, sleep=self.sleep))

    def utilization(self, group: GroupSpec, workers: Sequence[WorkerOutcome]) -> dict[int, float | None] | None:
        """NVML's utilization of each rank's GPU on this host (None: a CPU run)."""
        if not group.use_gpu:
            return None
        return gpu_utilization({w.rank: w.devices[0] for w in workers if w.devices})

    def end_earlier_attempts(self, group: GroupSpec) -> list[HostRelease]:
        ended = end_marked_processes({RUN_KEY_ENV: group.run_key, GROUP_ENV: group.name},
                                     min(group.grace_period_s, ORPHAN_GRACE_S))
        if ended["found"]:
            self._gpus_settle_until = self.clock() + GPU_RELEASE_WAIT_S
        return [HostRelease.of(socket.gethostname(), ended)]

    def release(self, run_key: str, records: Sequence[StateRecord], grace_s: float = RELEASE_GRACE_S) -> ReleaseResult:
        """Every process of the run on this host, found by the marker each carries (so also one no record names,
        or a grandchild), ended; the launcher work directories the records name removed; GPUs checked: waited for,
        bounded, until the run's processes left them and the memory they held came back."""
        # The GPU holders are the processes that carry the run's marker: a record is storage content, and a pid it
        # names may by now be any other process, which release must neither blame nor tell anyone to kill.
        watch = watch_release(set(processes_with_env({RUN_KEY_ENV: run_key})), placed_gpus(records),
                              recorded_idle_mb(records))
        ended = end_marked_processes({RUN_KEY_ENV: run_key}, grace_s)
        removed, kept = [], []
        for workdir in {r.workdir for r in records if r.workdir}:
            if is_launcher_workdir(workdir):
                shutil.rmtree(workdir, ignore_errors=True)
                removed.append(workdir)
            elif os.path.exists(workdir):
                kept.append(workdir)
                log.warning("Not removing %s: not a launcher work directory of this user under %s.", workdir,
                            tempfile.gettempdir())
        gpus = release_check(watch, environ=self.environ)
        host = HostRelease.of(socket.gethostname(), {**ended, "removed_dirs": sorted(removed), "gpu_check": gpus})
        return ReleaseResult(self.name, (host,), clean=not ended["survivors"] and release_is_clean(gpus))


def placed_gpus(records: Sequence[StateRecord]) -> set[str] | None:
    """The GPUs (UUID or index) the records' workers were placed on; None when a worker's record does not say."""
    workers = [w for r in records for w in r.workers]
    if not workers or any(w.gpus is None for w in workers):
        return None
    return {str(gpu) for w in workers for gpu in w.gpus or ()}


def recorded_idle_mb(records: Sequence[StateRecord]) -> dict[str, int]:
    """The idle levels the records' placements read (GPU name -> MiB); a GPU no record gives one for is judged as
    never seen idle."""
    return idle_levels_mb({name: mb for r in records for w in r.workers for name, mb in (w.gpu_idle_mb or {}).items()})


def _too_few_gpus(gpus: GpuInventory, num_workers: int) -> str:
    host = gpus.host or socket.gethostname()
    if gpus.unavailable:
        return (f"use_gpu is on but NVML is unavailable on host {host} ({gpus.unavailable}): install the NVIDIA "
                "driver and nvidia-ml-py there, run on a GPU host, or set use_gpu to false to run on CPU.")
    left_out = f" Left out: {gpus.describe_left_out()}." if gpus.left_out else ""
    if not gpus.free:
        return (f"use_gpu is on but NVML finds no free GPU on host {host} (num_workers={num_workers}).{left_out} "
                "Free a GPU, or set use_gpu to false to run on CPU.")
    return (f"use_gpu is on and num_workers={num_workers} needs one GPU per worker, but host {host} has "
            f"{len(gpus.free)} free GPU(s) {gpus.free_indices} (NVML; a GPU with a process or memory in use is not "
            f"free).{left_out} Lower num_workers to {len(gpus.free)} or less, free the GPUs, or set use_gpu to "
            "false.")
