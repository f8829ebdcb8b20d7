"""What a host has installed, read without importing it: package versions from metadata, GPUs through NVML.

Standard library only (plus `pynvml` where installed): the SSH agent (`launcher.agent`) imports it on
every host, the launcher and GPU admission ask NVML through it, and `trainer.host_info` builds the worker's view on
it, so a version or a GPU is read one way everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from types import ModuleType

# Packages every worker of a group must have in the same version. Their distribution names are the keys of every
# versions dict (the agent's announcement, the preflight's reports, the training summary, the baseline key).
VERSIONED_PACKAGES = ("tensorflow", "safetensors", "transformers", "numpy")


class NvmlUnavailable(Exception):
    """No NVML on this host: nvidia-ml-py is not installed, or it finds no driver (a CPU machine)."""


def package_versions(packages: Iterable[str] = VERSIONED_PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution, None where it is not installed."""
    versions: dict[str, str | None] = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def start_nvml() -> ModuleType:
    """pynvml, initialised and left so (a sampler that asks every step); raises NvmlUnavailable saying why not."""
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("nvidia-ml-py not installed") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        raise NvmlUnavailable(str(error)) from None
    return pynvml


@contextmanager
def nvml() -> Iterator[ModuleType]:
    """pynvml for one probe: initialised on entry, shut down on exit; raises NvmlUnavailable as `start_nvml`."""
    pynvml = start_nvml()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()
