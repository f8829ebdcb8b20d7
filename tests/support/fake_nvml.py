"""A stand-in for `pynvml` (nvidia-ml-py) with the real library's shapes, for tests and
`bench/gpu_release_check.py --dry-run`: put it where `import pynvml` finds it (`install`, or
`monkeypatch.setitem(sys.modules, "pynvml", fake)`).

What it copies from nvidia-ml-py 13 (`pynvml.py`): the NVML_ERROR_* codes, `NVMLError` whose constructor returns the
subclass of the code (`NVMLError(3)` is an `NVMLError_NotSupported`, `str()` is NVML's text), the functions the
project calls with their return shapes (processes with `pid` and `usedGpuMemory`, memory with `total`/`free`/`used`,
`str` names and UUIDs), and calls before `nvmlInit` raising Uninitialized. tests/test_fake_nvml.py checks the
codes and class names against the installed library and that every `pynvml.nvml*` the project calls exists here.

What it models, from the measured H200 (driver 580.159.04) and docs/research (gpu_paths_review.md, sections 3-6):
- an idle GPU as that H200 reported it (../shared/research/gpu_h200_measurements.md): 143,771 MiB total and 615 MiB
  `used` through the v1 struct with no process on it, before a run and after. The v2 struct
  (`nvmlDeviceGetMemoryInfo(handle, version=nvmlMemory_v2)`) was not measured there: the fake splits the same 615 MiB
  into `reserved` 512 MiB and `used` 103 MiB, a model chosen so that v2's idle `used` is neither 0 nor v1's figure
  (bench/gpu_release_check.py prints the real split). A driver without the v2 struct: `FakeGpu.memory_v2_error`
  (FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH or NOT_SUPPORTED); one whose v2 splits nothing out: `reserved_bytes=0`;
- an ended process stays listed, and its memory in use, for `list_lag_s` (measured 0.09-0.12 s after SIGKILL or
  SIGTERM);
- a process of another PID namespace: absent from the list on drivers >= 570 (`listed_pid=None`), its memory still
  in `nvmlDeviceGetMemoryInfo().used`; or listed by its host pid on older drivers (`listed_pid=<host pid>`);
- per-device errors (`FakeGpu.errors`: function name -> code, e.g. NO_PERMISSION from nvmlDeviceGetHandleByIndex,
  which nvmlDeviceGetCount still counts), a lost GPU (`lose`), MIG (utilization NotSupported), an index or UUID
  that does not exist (INVALID_ARGUMENT / NOT_FOUND), NVML that cannot start (`init_error`).
"""

from __future__ import annotations

import string
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

ERROR_CODES = {name: value for name, value in globals().items() if name.startswith("NVML_ERROR_")}
MEASURED_LIST_LAG_S = 0.1  # the H200's 0.09-0.12 s
GIB = 1 << 30
MIB = 1 << 20
MEASURED_IDLE_USED_BYTES = 615 * MIB  # the H200's v1 `used` with no process on it
MODELLED_RESERVED_BYTES = 512 * MIB  # v2's `reserved` of those 615 MiB: a model, not measured
nvmlMemory_v2 = 0x02000028  # nvidia-ml-py's version word of the v2 struct (its size, 40, and version 2)
# The functions that take a device handle: a lost GPU answers every one of them with GPU_IS_LOST.
DEVICE_FUNCTIONS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetIndex", "nvmlDeviceGetMemoryInfo",
                    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetUtilizationRates")


class NVMLError(Exception):
    """As nvidia-ml-py's: `NVMLError(code)` builds the code's subclass; `.value` is the code."""

    _valClassMapping: ClassVar[dict[int, type]] = {}  # nvidia-ml-py's name
    _errcode_to_string: ClassVar[dict[int, str]] = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized", NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_UNKNOWN: "Unknown Error"}

    def __new__(cls, value: int):
        error_class = NVMLError._valClassMapping.get(value, cls) if cls is NVMLError else cls
        error = Exception.__new__(error_class)
        error.value = value
        return error

    def __str__(self) -> str:
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


def _error_classes() -> dict[str, type]:
    """NVMLError_NotSupported, NVMLError_GpuIsLost, ...: named as nvidia-ml-py's `_extractNVMLErrorsAsClasses`."""
    classes = {}
    for name, value in ERROR_CODES.items():
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls, *_args, _value=value):
            return NVMLError.__new__(cls, _value)

        error_class = type(class_name, (NVMLError,), {"__new__": new})
        NVMLError._valClassMapping[value] = error_class
        classes[class_name] = error_class
    return classes


ERROR_CLASSES = _error_classes()
globals().update(ERROR_CLASSES)


@dataclass
class FakeGpu:
    """One device. `idle_used_bytes`: what v1's `used` reads with no process on it (the driver's own share, its
    reservation included); `reserved_bytes`: the part of it v2 reports as `reserved`; `memory_v2_error`: the NVML
    error a driver without the v2 struct answers it with; `utilization_pct`: what nvmlDeviceGetUtilizationRates reads
    as `.gpu` (None: 97 with a process on it, else 0)."""

    uuid: str
    name: str = "NVIDIA H200"
    total_bytes: int = 143771 * MIB
    idle_used_bytes: int = MEASURED_IDLE_USED_BYTES
    reserved_bytes: int = MODELLED_RESERVED_BYTES
    memory_v2_error: int | None = None
    mig: bool = False
    utilization_pct: int | None = None
    errors: dict[str, int] = field(default_factory=dict)  # function name -> NVML_ERROR_* it raises for this GPU


@dataclass
class FakeProcess:
    """A compute process on one GPU. `listed_pid`: the pid NVML reports, None when the driver drops it (another PID
    namespace, drivers >= 570); `alive`: a real process's liveness (the dry run's stand-ins), None for a simulated one
    that lives until `FakeNvml.end_process`."""

    pid: int
    gpu: int
    used_bytes: int
    listed_pid: int | None
    alive: Callable[[], bool] | None = None
    ended_at: float | None = None


@dataclass(frozen=True)
class FakeHandle:
    """Opaque, as nvidia-ml-py's `c_nvmlDevice_t`."""

    index: int


def pid_alive(pid: int) -> bool:
    """A real process still running (a zombie is not: it holds no GPU)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class FakeNvml(types.ModuleType):
    """The `pynvml` module of a host with `gpus`; `clock` decides when an ended process leaves the list."""

    def __init__(self, gpus: Sequence[FakeGpu], *, list_lag_s: float = MEASURED_LIST_LAG_S,
                 clock: Callable[[], float] = time.monotonic, driver: str = "580.159.04",
                 init_error: int | None = None) -> None:
        super().__init__("pynvml")
        self.gpus = list(gpus)
        self.processes: list[FakeProcess] = []
        self.list_lag_s = list_lag_s
        self.clock = clock
        self.driver = driver
        self.init_error = init_error
        self.initialised = 0
        self.calls: list[str] = []
        self.NVMLError = NVMLError
        self.nvmlMemory_v2 = nvmlMemory_v2
        self.__dict__.update(ERROR_CODES)
        self.__dict__.update(ERROR_CLASSES)

    # -- the test's side -----------------------------------------------------------------------------------------

    def start_process(self, gpu: int, used_bytes: int, *, pid: int | None = None, listed_pid: int | None | str = "same",
                      alive: Callable[[], bool] | None = None) -> FakeProcess:
        """A process holding `used_bytes` on GPU `gpu`; `listed_pid="same"` lists it by its own pid."""
        pid = pid if pid is not None else 100000 + len(self.processes)
        process = FakeProcess(pid, gpu, used_bytes, pid if listed_pid == "same" else listed_pid, alive)
        self.processes.append(process)
        return process

    def attach(self, pid: int, gpu: int, used_bytes: int) -> FakeProcess:
        """A real process of this namespace (a stand-in worker) holding `used_bytes` on `gpu` until it exits."""
        return self.start_process(gpu, used_bytes, pid=pid, alive=lambda: pid_alive(pid))

    def end_process(self, pid: int) -> None:
        """The process exits now; NVML keeps listing it for `list_lag_s`."""
        for process in self.processes:
            if process.pid == pid and process.ended_at is None:
                process.ended_at = self.clock()

    def lose(self, index: int) -> None:
        """GPU `index` falls off the bus: every query of it answers GPU_IS_LOST."""
        self.gpus[index].errors.update(dict.fromkeys(DEVICE_FUNCTIONS, NVML_ERROR_GPU_IS_LOST))

    def _on_device(self, index: int) -> list[FakeProcess]:
        now = self.clock()
        present = []
        for process in self.processes:
            if process.ended_at is None and process.alive is not None and not process.alive():
                process.ended_at = now
            if process.gpu == index and (process.ended_at is None or now < process.ended_at + self.list_lag_s):
                present.append(process)
        return present

    def _call(self, function: str, handle: FakeHandle | None = None) -> FakeGpu | None:
        self.calls.append(function)
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        gpu = self.gpus[handle.index]
        if function in gpu.errors:
            raise NVMLError(gpu.errors[function])
        return gpu

    # -- pynvml's side ---------------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._call("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)  # also the GPUs this caller may not open (NVML's reference, nvmlDeviceGetCount_v2)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._call("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        code = self.gpus[index].errors.get("nvmlDeviceGetHandleByIndex")
        if code is not None:
            raise NVMLError(code)
        return FakeHandle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        self._call("nvmlDeviceGetHandleByUUID")
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid == wanted:
                return FakeHandle(index)
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._call("nvmlDeviceGetIndex", handle)
        return handle.index

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._call("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._call("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[types.SimpleNamespace]:
        self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        return [types.SimpleNamespace(pid=p.listed_pid, usedGpuMemory=p.used_bytes, gpuInstanceId=0xFFFFFFFF,
                                      computeInstanceId=0xFFFFFFFF)
                for p in self._on_device(handle.index) if p.listed_pid is not None]

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> types.SimpleNamespace:
        """v1 (no `version`): total, free, used with the reservation in it; v2: version, total, reserved, free, used
        without it, the fields of nvidia-ml-py's c_nvmlMemory_v2_t."""
        gpu = self._call("nvmlDeviceGetMemoryInfo", handle)
        used = gpu.idle_used_bytes + sum(p.used_bytes for p in self._on_device(handle.index))
        if not version:
            return types.SimpleNamespace(total=gpu.total_bytes, free=gpu.total_bytes - used, used=used)
        if gpu.memory_v2_error is not None:
            raise NVMLError(gpu.memory_v2_error)
        if version != nvmlMemory_v2:
            raise NVMLError(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        reserved = min(gpu.reserved_bytes, gpu.idle_used_bytes)
        return types.SimpleNamespace(version=version, total=gpu.total_bytes, reserved=reserved,
                                     free=gpu.total_bytes - used, used=used - reserved)

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> types.SimpleNamespace:
        gpu = self._call("nvmlDeviceGetUtilizationRates", handle)
        if gpu.mig:  # NVML's reference: "On MIG-enabled GPUs, querying device utilization rates is not ... supported"
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        busy = bool(self._on_device(handle.index))
        percent = gpu.utilization_pct if gpu.utilization_pct is not None else 97 if busy else 0
        return types.SimpleNamespace(gpu=percent, memory=60 if busy else 0)


def h200s(count: int, **overrides) -> list[FakeGpu]:
    """`count` idle H200s with stable UUIDs."""
    return [FakeGpu(uuid=f"GPU-{index:08x}-fa4e-4e00-8000-00000000c0de", **overrides) for index in range(count)]


def install(monkeypatch, fake: FakeNvml) -> FakeNvml:
    """`import pynvml` finds `fake` for the rest of the test."""
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake
