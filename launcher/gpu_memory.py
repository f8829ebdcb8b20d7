"""A GPU's memory as NVML reports it, and up to what figure that memory counts as idle.

An idle GPU is not "0 MiB used": an idle H200 (143,771 MiB, driver 580.159.04) reads 615 MiB `used` through NVML's
v1 struct with no process on it, the driver's reservation included, and the same after a run
(../shared/research/gpu_h200_measurements.md). NVML's v2 struct (`nvmlDeviceGetMemoryInfo(handle,
version=nvmlMemory_v2)`) reports that reservation apart from `used`; drivers without it refuse the call, and then v1
is read. So the idle level is the device's own: recorded per GPU at placement (what it reads while NVML lists no
process on it), waited for at release; only a GPU never seen idle is judged by an allowance scaled to the device.

Standard library only (plus `pynvml` where installed): the SSH agent imports it on every host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

MIB = 1 << 20
# A bare CUDA context takes 0.5-0.8 GiB (about 780 MiB per context measured on an H200). Half the smallest is the
# margin over a GPU's recorded idle level: a context left behind always exceeds it, drift of the driver's own
# bookkeeping does not (the H200 read the same 615 MiB before and after a run).
SMALLEST_CONTEXT_BYTES = 512 * MIB
IDLE_MARGIN_BYTES = SMALLEST_CONTEXT_BYTES // 2
# Replaces the allowance for a GPU never seen idle (first_allowance), for hosts whose idle GPUs read higher.
IDLE_USED_MB_ENV = "TFMW_GPU_IDLE_USED_MB"


@dataclass(frozen=True)
class Memory:
    """One reading of a GPU's memory. `reserved`: the driver's reservation as v2 reports it apart from `used`; None
    when v1 was read (the reservation is inside `used` then). `note`: why v1 was read where v2 was asked for."""

    used: int
    total: int
    reserved: int | None = None
    note: str | None = None

    @property
    def call(self) -> str:
        return "v1" if self.reserved is None else "v2"

    @property
    def occupied(self) -> int:
        """`used` with the reservation in it, whichever call read it (v1's `used`): the figure idle levels are
        recorded and compared on, so a level read by one call holds for a check read by the other."""
        return self.used + (self.reserved or 0)

    def record(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"used_mb": self.used // MIB, "memory_call": self.call}
        if self.reserved is not None:
            entry["reserved_mb"] = self.reserved // MIB
        if self.note:
            entry["memory_note"] = self.note
        return entry


def read_memory(pynvml: ModuleType, handle: Any) -> Memory:
    """The v2 struct where the driver has it, else v1; any other NVML error (a lost GPU, no permission) is raised."""
    try:
        version = pynvml.nvmlMemory_v2
    except AttributeError:  # an nvidia-ml-py older than the v2 struct
        version, note = None, "this nvidia-ml-py has no v2 struct"
    if version is not None:
        try:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return Memory(memory.used, memory.total, memory.reserved)
        except pynvml.NVMLError as error:
            # What a driver without the v2 struct answers (nvidia-ml-py asks for nvmlDeviceGetMemoryInfo_v2).
            if error.value not in (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
                                   pynvml.NVML_ERROR_NOT_SUPPORTED):
                raise
            note = f"the driver refused the v2 struct ({type(error).__name__}: {error})"
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return Memory(memory.used, memory.total, note=note)


def first_allowance(memory: Memory, listed_bytes: int, override: int | None = None) -> tuple[bool, str]:
    """Whether a GPU never seen idle is idle: the memory no listed process accounts for within an allowance scaled to
    the device; and that figure against the allowance, for messages.

    With the reservation inside (v1's `used`, `Memory.occupied`): total / 160, at least one context. The measured idle
    H200 reads 615 MiB of 143,771 (total / 234); total / 160 there is 898 MiB: 283 MiB above that, and below idle
    plus the smallest bare context of another namespace (615 + 512 = 1,127 MiB).
    Where v2 sets the reservation apart, its `used` may also pass: total / 512, at least half a context (280 MiB on an
    H200). An idle GPU's v2 `used` is the driver's bookkeeping, far below a context, so a reservation of any size is
    no longer mistaken for use; a driver whose v2 leaves part of it in `used` still passes on the first figure; a
    foreign context passes neither. `override` (`TFMW_GPU_IDLE_USED_MB`) replaces both with one figure, on the first.
    """
    occupied = max(0, memory.occupied - listed_bytes)
    seen = f"{occupied // MIB} MiB are in use by no listed process"
    if override is not None:
        return occupied <= override, f"{seen}; idle is up to {override // MIB} MiB (set by {IDLE_USED_MB_ENV})"
    whole = max(SMALLEST_CONTEXT_BYTES, memory.total // 160)
    scale = f"scaled to its {memory.total // MIB} MiB; {IDLE_USED_MB_ENV} overrides it"
    if not memory.reserved:
        return occupied <= whole, f"{seen} (NVML {memory.call}); idle is up to {whole // MIB} MiB ({scale})"
    outside = max(0, memory.used - listed_bytes)
    apart = max(IDLE_MARGIN_BYTES, memory.total // 512)
    figures = (f"{seen}, {outside // MIB} MiB of them outside the driver's reservation (NVML v2); idle is up to "
               f"{whole // MIB} MiB, or {apart // MIB} MiB outside the reservation ({scale})")
    return occupied <= whole or outside <= apart, figures


def allowance_override(environ: Mapping[str, str] = os.environ) -> int | None:
    """`TFMW_GPU_IDLE_USED_MB` in bytes; None when unset."""
    raw = environ.get(IDLE_USED_MB_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{IDLE_USED_MB_ENV}={raw!r} is not a whole number of MiB: fix or unset it")
    return int(raw) * MIB


def idle_levels_mb(entries: Mapping[str, Any] | None) -> dict[str, int]:
    """A GPU name (UUID or index) -> idle level (MiB) mapping read from storage or a request: the entries that are
    one; a malformed one is dropped, so that GPU is judged as never seen idle."""
    if not isinstance(entries, Mapping):
        return {}
    return {str(name): level for name, level in entries.items()
            if isinstance(level, int) and not isinstance(level, bool) and level >= 0}
