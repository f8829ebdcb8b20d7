"""This worker's host as the reports show it: package versions, this project's code hash, its GPUs and its CPU.

Nothing here imports TensorFlow: versions come from package metadata and GPUs from NVML, both through the
launcher's `host_probe`, which the SSH agent shares, so every report spells a version and counts a GPU alike.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import socket
from pathlib import Path
from types import ModuleType
from typing import Any

from launcher.host_probe import NvmlUnavailable, nvml, package_versions, start_nvml

# This project's code that runs on the workers' hosts. Ranks with different copies may shard the data differently
# or wait in a collective only some of them run, and no package version shows it.
CODE_PACKAGES = ("core", "launcher", "trainer")


def versions() -> dict[str, str | None]:
    """Python's version and the versioned packages' (keyed by distribution name, None where not installed)."""
    return {"python": platform.python_version(), **package_versions()}


def code_fingerprint(locations: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """sha256 of this host's copy of CODE_PACKAGES (package -> its directories, found without importing them: the
    operator module imports Airflow): one digest for the whole, and a short one per file to name what differs."""
    if locations is None:
        specs = {package: importlib.util.find_spec(package) for package in CODE_PACKAGES}
        locations = {package: list(spec.submodule_search_locations or []) for package, spec in specs.items() if spec}
    files = {}
    for package, roots in sorted(locations.items()):
        for root in roots:
            for path in sorted(Path(root).rglob("*.py")):
                name = f"{package}/{path.relative_to(root).as_posix()}"
                files[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"fingerprint": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16],
            "files": files}


def visible_gpus() -> dict[str, Any]:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES as the launcher pinned it: UUIDs, or indices) with NVML name
    and memory; an entry NVML cannot open (no such index or UUID, NO_PERMISSION, GPU_IS_LOST) goes to `unusable`,
    naming this host, the entry and NVML's error."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        with nvml() as pynvml:
            count = pynvml.nvmlDeviceGetCount()
            entries = [str(i) for i in range(count)] if visible is None else [
                entry.strip() for entry in visible.split(",") if entry.strip()]
            gpus, unusable = [], []
            for entry in entries:
                try:
                    gpus.append(_describe_gpu(pynvml, entry))
                except pynvml.NVMLError as error:
                    unusable.append(f"CUDA_VISIBLE_DEVICES entry {entry!r} on host {socket.gethostname()}: NVML "
                                    f"cannot open it ({type(error).__name__}: {error}); NVML counts {count} GPU(s) "
                                    "here")
            report = {"nvml": pynvml.nvmlSystemGetDriverVersion(), "cuda_visible_devices": visible, "gpus": gpus}
            return {**report, "unusable": unusable} if unusable else report
    except NvmlUnavailable as reason:
        return {"nvml": f"unavailable ({reason})", "cuda_visible_devices": visible, "gpus": []}


def _describe_gpu(pynvml: ModuleType, entry: str) -> dict[str, Any]:
    """One CUDA_VISIBLE_DEVICES entry: an NVML index, or a UUID (GPU-..., MIG-...), as CUDA reads it."""
    handle = (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
              else pynvml.nvmlDeviceGetHandleByUUID(entry))
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    name, uuid = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetUUID(handle)
    return {"index": pynvml.nvmlDeviceGetIndex(handle), "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
            "name": name.decode() if isinstance(name, bytes) else name,
            "memory_total_mb": memory.total >> 20, "memory_free_mb": memory.free >> 20}


def worker_gpu() -> tuple[ModuleType, Any]:
    """pynvml and the handle of this worker's GPU (the first of CUDA_VISIBLE_DEVICES, an index or a UUID), NVML left
    initialised for the sampler that asks every step; raises NvmlUnavailable or pynvml's error."""
    pynvml = start_nvml()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit() else (
        pynvml.nvmlDeviceGetHandleByUUID(visible))
    return pynvml, handle


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info(gpu_name: str | None, device_kind: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": device_kind,
        "gpu": gpu_name,
    }
