"""This host's GPUs as NVML shows them, and the evidence that one is free or that a run released it.

NVML's process list alone proves neither (docs: ../shared/research/gpu_paths_review.md, sections 3, 4 and 6):
- a killed process stays listed for 0.09-0.12 s after `/proc` stops showing it (measured on an H200, driver
  580.159.04), so release polls, bounded, instead of asking once;
- in a container with its own PID namespace, drivers >= 570 drop other namespaces' processes from the list while
  their memory stays in use (open-gpu-kernel-modules 570.86.15, `gpuGetProcWithObject_IMPL` -> `os_find_ns_pid`),
  so a GPU is free only when nothing is listed AND its used memory is near idle; older drivers list host pids
  that match no process here, and then whether the run left cannot be told: the check says "unverified";
- an idle GPU's memory is not 0 MiB used (615 MiB on the H200): what counts as idle is the device's own level,
  recorded at placement and waited for at release (launcher/gpu_memory.py);
- one GPU may refuse a query after `nvmlInit` (NO_PERMISSION, GPU_IS_LOST) while the others answer: that GPU is
  left out of placement and reported by release, named by index and UUID, instead of failing the whole probe.

Standard library only (plus `pynvml` where installed): the SSH agent imports it on every host.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from launcher.gpu_memory import (
    IDLE_MARGIN_BYTES,
    MIB,
    Memory,
    allowance_override,
    first_allowance,
    read_memory,
)
from launcher.host_probe import NvmlUnavailable, nvml

# How long release waits for the run's processes to leave the GPUs, and a relaunch for its stopped ranks' GPUs:
# measured lag 0.09-0.12 s; a large context torn down through the driver's deferred close can take longer.
GPU_RELEASE_WAIT_S = 10.0
GPU_POLL_S = 0.05


@dataclass(frozen=True)
class Gpu:
    """One GPU as NVML answered: the pids it lists, the memory they say they use, the device's memory; or the error
    NVML raised for this GPU alone."""

    index: int
    uuid: str | None = None
    pids: tuple[int, ...] = ()
    listed_bytes: int = 0
    memory: Memory | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        return f"GPU {self.index}" + (f" ({self.uuid})" if self.uuid else "")

    @property
    def names(self) -> set[str]:
        """How records and requests name it: its index and its UUID."""
        return {str(self.index)} | ({self.uuid} if self.uuid else set())

    @property
    def idle_mb(self) -> int | None:
        """Its idle level (MiB of `Memory.occupied`) when NVML lists no process on it and it answered; else None."""
        if self.pids or self.error or self.memory is None:
            return None
        return self.memory.occupied // MIB

    def record(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"gpu": self.index, "uuid": self.uuid, "pids": list(self.pids)}
        if self.memory is not None:
            entry.update(self.memory.record())
        if self.error:
            entry["error"] = self.error
        return entry


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _read_one(pynvml: ModuleType, index: int) -> Gpu:
    uuid = None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        memory = read_memory(pynvml, handle)
    except pynvml.NVMLError as error:
        return Gpu(index, uuid, error=f"{type(error).__name__}: {error}")
    # usedGpuMemory is None where NVML cannot tell (nvidia-ml-py maps NVML_VALUE_NOT_AVAILABLE to None).
    return Gpu(index, uuid, tuple(p.pid for p in processes), sum(p.usedGpuMemory or 0 for p in processes), memory)


def read_gpus(pynvml: ModuleType) -> list[Gpu]:
    """Every GPU NVML counts, each read on its own: one GPU's error does not hide the others."""
    return [_read_one(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]


def why_not_free(gpu: Gpu, override: int | None = None) -> str | None:
    """Why a worker must not be placed on `gpu`; None when it is free. `override`: `TFMW_GPU_IDLE_USED_MB` in bytes."""
    if gpu.error:
        return f"NVML cannot read it ({gpu.error})"
    if gpu.pids:
        return f"compute process(es) {list(gpu.pids)} use it"
    if gpu.memory is None:
        return "NVML gave no memory reading for it"
    idle, figures = first_allowance(gpu.memory, gpu.listed_bytes, override)
    if not idle:
        return f"{figures}: one of another PID namespace (the host, a container or a pod) may hold it"
    return None


@dataclass(frozen=True)
class GpuInventory:
    """Placement's view of this host: the free GPUs, those left out and why, or why NVML gave no answer."""

    free: tuple[Gpu, ...] = ()
    left_out: tuple[tuple[Gpu, str], ...] = ()
    unavailable: str | None = None
    host: str = ""

    @property
    def free_indices(self) -> list[int]:
        return [gpu.index for gpu in self.free]

    def describe_left_out(self) -> str:
        return "; ".join(f"{gpu.label}: {reason}" for gpu, reason in self.left_out)


def probe_gpus(environ: Mapping[str, str] = os.environ) -> GpuInventory:
    """This host's GPUs split into free and left out (with the reason); `unavailable` says why without NVML. A free
    GPU's reading is its idle level (`Gpu.idle_mb`), which placement records."""
    override = allowance_override(environ)
    try:
        with nvml() as pynvml:
            gpus = read_gpus(pynvml)
    except NvmlUnavailable as reason:
        return GpuInventory(unavailable=str(reason), host=socket.gethostname())
    verdicts = [(gpu, why_not_free(gpu, override)) for gpu in gpus]
    return GpuInventory(tuple(gpu for gpu, reason in verdicts if reason is None),
                        tuple((gpu, reason) for gpu, reason in verdicts if reason is not None),
                        host=socket.gethostname())


def in_this_namespace(pid: int) -> bool:
    """A pid NVML lists names a process of this PID namespace (older drivers list host pids: review section 3)."""
    return Path(f"/proc/{pid}").exists()


@dataclass(frozen=True)
class ReleaseWatch:
    """What release knows of the run's GPUs before ending its processes: which GPUs listed its pids, the GPUs its
    records say it was placed on (index or UUID; None when no record says), and their idle levels recorded at
    placement (GPU name -> MiB)."""

    run_pids: frozenset[int]
    held: frozenset[int] = frozenset()
    placed_on: frozenset[str] | None = None
    idle_mb: Mapping[str, int] = field(default_factory=dict)

    def may_hold(self, gpu: Gpu, gpus: list[Gpu]) -> bool:
        """The run may have used `gpu`: it listed a run pid, a record names it, no record says where the run ran,
        or NVML cannot say which GPU this is (a lost GPU answers no UUID) while a GPU the records name is missing."""
        if gpu.index in self.held or self.placed_on is None:
            return True
        if gpu.uuid is None:
            named = {str(g.index) for g in gpus if g.uuid} | {g.uuid for g in gpus if g.uuid}
            return bool(self.placed_on - named)
        return str(gpu.index) in self.placed_on or gpu.uuid in self.placed_on

    def memory_back(self, gpu: Gpu, override: int | None) -> tuple[bool, str]:
        """Whether the memory no listed process accounts for is back at `gpu`'s idle level, and the figure against
        the level: the one recorded at placement plus a margin, else the allowance of a GPU never seen idle."""
        level = next((self.idle_mb[name] for name in sorted(gpu.names) if name in self.idle_mb), None)
        if gpu.memory is None:
            return False, "NVML gave no memory reading for it"
        if level is None:
            idle, figures = first_allowance(gpu.memory, gpu.listed_bytes, override)
            return idle, f"{figures}; no idle level was recorded for it, so it is judged as a GPU never seen idle"
        figure = max(0, gpu.memory.occupied - gpu.listed_bytes)
        figures = (f"{figure // MIB} MiB are in use by no listed process (NVML {gpu.memory.call}); its idle level, "
                   f"recorded at placement, is {level} MiB (+ {IDLE_MARGIN_BYTES // MIB} MiB margin)")
        return figure <= level * MIB + IDLE_MARGIN_BYTES, figures


def gpus_held(gpus: Iterable[Gpu], run_pids: set[int]) -> frozenset[int]:
    return frozenset(gpu.index for gpu in gpus if set(gpu.pids) & run_pids)


def _unsettled(gpus: list[Gpu], watch: ReleaseWatch, override: int | None) -> list[tuple[Gpu, int | None]]:
    """(GPU, run pid still listed) for each lingering run pid, and (GPU, None) for a GPU the run held whose memory
    has not come back to its idle level yet."""
    lingering: list[tuple[Gpu, int | None]] = [(gpu, pid) for gpu in gpus for pid in gpu.pids
                                               if pid in watch.run_pids]
    lingering += [(gpu, None) for gpu in gpus
                  if gpu.index in watch.held and not gpu.error and not watch.memory_back(gpu, override)[0]]
    return lingering


def _missing(gpus: list[Gpu], watch: ReleaseWatch) -> list[dict[str, Any]]:
    """The GPUs the records name that NVML no longer lists (fallen off the bus, or a host's GPUs renumbered), unless
    an unreadable GPU without a UUID may be one of them (it is reported unverified itself)."""
    wanted = (watch.placed_on or frozenset()) | frozenset(watch.idle_mb)
    if any(gpu.error and gpu.uuid is None for gpu in gpus):
        return []
    listed = set().union(*(gpu.names for gpu in gpus))
    return [{"gpu": None, "uuid": name,
             "reason": (f"the run was placed on GPU {name}, but NVML on host {socket.gethostname()} lists no such GPU "
                        f"among its {len(gpus)}: whether the run's processes left it is unknown")}
            for name in sorted(wanted - listed)]


def _unverified(gpus: list[Gpu], watch: ReleaseWatch, override: int | None, unsettled: list[tuple[Gpu, int | None]],
                here: Callable[[int], bool]) -> list[dict[str, Any]]:
    """GPUs the run may have used whose state NVML leaves open: an error (a GPU lost mid-run must not pass as
    released), pids that are no process of this namespace, held memory that never came back, or a GPU gone."""
    found = []
    for gpu in (g for g in gpus if watch.may_hold(g, gpus)):
        reason = None
        if gpu.error:
            reason = f"NVML cannot read it ({gpu.error}): whether the run's processes left it is unknown"
        elif foreign := [pid for pid in gpu.pids if pid not in watch.run_pids and not here(pid)]:
            reason = (f"NVML lists pid(s) {foreign}, which are no process of this PID namespace (the driver reports "
                      "host pids; drivers before 570 do so in containers): the run's processes cannot be told apart")
        elif any(g.index == gpu.index and pid is None for g, pid in unsettled):
            reason = f"the run held it and {watch.memory_back(gpu, override)[1]}"
        if reason:
            found.append({"gpu": gpu.index, "uuid": gpu.uuid, "reason": reason})
    return found + _missing(gpus, watch)


def watch_release(run_pids: set[int], placed_on: Iterable[str] | None = None,
                  idle_mb: Mapping[str, int] | None = None) -> ReleaseWatch:
    """Which GPUs list the run's pids now, before release ends them (none without NVML)."""
    placed = None if placed_on is None else frozenset(placed_on)
    try:
        with nvml() as pynvml:
            held = gpus_held(read_gpus(pynvml), run_pids)
    except NvmlUnavailable:
        held = frozenset()
    return ReleaseWatch(frozenset(run_pids), held, placed, dict(idle_mb or {}))


def release_check(watch: ReleaseWatch, *, wait_s: float = GPU_RELEASE_WAIT_S, environ: Mapping[str, str] = os.environ,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                  here: Callable[[int], bool] = in_this_namespace) -> dict[str, Any]:
    """After release ended the run's processes: waits up to `wait_s` for their pids to leave every GPU and for the
    memory of the GPUs they held to come back to its idle level. `held_by_run` names only processes that never left;
    `unverified` the GPUs NVML cannot vouch for; `free_after_s` how long the GPUs took (None when they never did)."""
    override = allowance_override(environ)
    started = clock()
    try:
        with nvml() as pynvml:
            gpus = read_gpus(pynvml)
            while (unsettled := _unsettled(gpus, watch, override)) and clock() - started < wait_s:
                sleep(GPU_POLL_S)
                gpus = read_gpus(pynvml)
    except NvmlUnavailable:
        return {"nvml": False, "note": "no NVML: no GPU to verify on this host"}
    return {"nvml": True, "devices": [gpu.record() for gpu in gpus],
            "held_by_run": [{"gpu": gpu.index, "uuid": gpu.uuid, "pid": pid} for gpu, pid in unsettled
                            if pid is not None],
            "unverified": _unverified(gpus, watch, override, unsettled, here),
            "free_after_s": None if unsettled else round(clock() - started, 3), "waited_limit_s": wait_s}


def _placed_indices(pynvml: ModuleType, placed: frozenset[str]) -> frozenset[int]:
    """The indices of the GPUs named in `placed` (by index or UUID)."""
    return frozenset(gpu.index for gpu in read_gpus(pynvml) if str(gpu.index) in placed or gpu.uuid in placed)


@dataclass(frozen=True)
class Polling:
    """How a check waits: up to `wait_s` seconds of `clock`, sleeping with `sleep` (tests pass a fake clock)."""

    wait_s: float = GPU_RELEASE_WAIT_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep


def check_exited_slots(run_pids: Iterable[int], placed_on: Iterable[str], *, use_gpu: bool,
                       alive: Callable[[], list[int]], idle_mb: Mapping[str, int] | None = None,
                       environ: Mapping[str, str] = os.environ, polling: Polling = Polling()) -> dict[str, Any]:
    """Right after a group exited, on its host: the slots it held are free. A CPU slot (this host and a rank) is free
    once the rank's processes are gone (`alive()` lists those still running); a GPU once `release_check` finds the
    group's pids gone from it and the memory of the GPUs it was placed on back to the idle levels placement recorded
    (`idle_mb`: GPU name -> MiB), both polled up to `wait_s`.
    `free_after_s`: seconds from this call to the proof (None: not proven; `release` checks again)."""
    wait_s, clock, sleep = polling.wait_s, polling.clock, polling.sleep
    started = clock()
    while (left := alive()) and clock() - started < wait_s:
        sleep(GPU_POLL_S)
    check: dict[str, Any] = {"checked": True, "slots": "gpu" if use_gpu else "cpu", "processes_left": left}
    if use_gpu:
        placed = frozenset(str(device) for device in placed_on)
        try:
            with nvml() as pynvml:
                held = _placed_indices(pynvml, placed)
        except NvmlUnavailable:
            held = frozenset()
        remaining = max(0.0, wait_s - (clock() - started))
        watch = ReleaseWatch(frozenset(run_pids), held, placed, dict(idle_mb or {}))
        check["gpu_check"] = release_check(watch, wait_s=remaining, environ=environ, clock=clock, sleep=sleep)
    gpus_free = not use_gpu or (release_is_clean(check["gpu_check"]) and check["gpu_check"].get("nvml") is True)
    check["free"] = not left and gpus_free
    check["free_after_s"] = round(clock() - started, 3) if check["free"] else None
    return check


def _handle(pynvml: ModuleType, device: int | str) -> Any:
    """The NVML handle of a GPU named by its UUID (GPU-..., MIG-...) or its index."""
    text = str(device)
    return pynvml.nvmlDeviceGetHandleByIndex(int(text)) if text.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(text)


def gpu_utilization(devices: Mapping[int, int | str]) -> dict[int, float | None]:
    """Key -> NVML's utilization (%) of the GPU `devices` names for it (UUID or index), None for a GPU that refuses the
    query (MIG: NotSupported; lost) or without NVML: a missing sample, never a 0."""
    try:
        with nvml() as pynvml:
            found: dict[int, float | None] = {}
            for key, device in devices.items():
                try:
                    found[key] = float(pynvml.nvmlDeviceGetUtilizationRates(_handle(pynvml, device)).gpu)
                except (pynvml.NVMLError, ValueError):
                    found[key] = None
            return found
    except NvmlUnavailable:
        return dict.fromkeys(devices)


def release_is_clean(gpu_check: Mapping[str, Any]) -> bool:
    """No process of the run left on a GPU and no GPU NVML could not vouch for (no NVML: nothing to verify)."""
    return not gpu_check.get("held_by_run") and not gpu_check.get("unverified")
