"""tests/support/fake_nvml.py keeps the real library's shapes: the error codes and classes of the installed
nvidia-ml-py, and every NVML function the project calls, found by reading the source (so a new call that the fake
lacks fails here, not as an AttributeError in some other test)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest

from tests.support import fake_nvml
from tests.support.fake_nvml import FakeGpu, FakeNvml, h200s

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("core", "launcher", "trainer", "tasks", "plugins", "dags", "bench")


def nvml_names_used() -> dict[str, str]:
    """Every attribute `nvml*` / `NVML*` the project reads off an object (pynvml, or a variable holding it)."""
    used = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and node.attr.lower().startswith("nvml"):
                    used.setdefault(node.attr, f"{path.relative_to(REPO)}:{node.lineno}")
    return used


def real_pynvml():
    if importlib.util.find_spec("pynvml") is None:
        pytest.skip("nvidia-ml-py is not installed")
    return importlib.import_module("pynvml")


def test_the_fake_has_every_nvml_name_the_project_uses_and_so_does_nvidia_ml_py():
    used = nvml_names_used()
    assert {"nvmlInit", "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMemoryInfo"} <= set(used)
    fake, real = FakeNvml(h200s(1)), real_pynvml()
    assert [f"{name} ({where})" for name, where in used.items() if not hasattr(fake, name)] == []
    assert [f"{name} ({where})" for name, where in used.items() if not hasattr(real, name)] == []
    for name in used:
        if callable(getattr(real, name)) and inspect.isfunction(getattr(real, name)):
            real_params = list(inspect.signature(getattr(real, name)).parameters)
            assert list(inspect.signature(getattr(fake, name)).parameters) == real_params, name


def test_error_codes_and_classes_are_nvidia_ml_pys():
    real = real_pynvml()
    assert fake_nvml.ERROR_CODES == {name: getattr(real, name) for name in dir(real) if name.startswith("NVML_ERROR_")}
    for class_name, error_class in fake_nvml.ERROR_CLASSES.items():
        real_error = real.NVMLError(error_class().value)
        assert type(real_error).__name__ == class_name
        fake_error = fake_nvml.NVMLError(real_error.value)
        assert type(fake_error) is error_class and fake_error.value == real_error.value
        if real_error.value in fake_nvml.NVMLError._errcode_to_string:
            assert str(fake_error) == str(real_error)


def test_a_call_before_init_raises_uninitialized_as_the_library_does():
    fake = FakeNvml(h200s(1))
    with pytest.raises(fake_nvml.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()


def test_an_ended_process_stays_listed_for_the_lag_and_its_memory_with_it():
    now = [0.0]
    fake = FakeNvml(h200s(1), clock=lambda: now[0])
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    fake.start_process(0, 8 * fake_nvml.GIB, pid=4242)
    fake.end_process(4242)
    now[0] = 0.09
    assert [p.pid for p in fake.nvmlDeviceGetComputeRunningProcesses(handle)] == [4242]
    now[0] = 0.11
    assert fake.nvmlDeviceGetComputeRunningProcesses(handle) == []
    assert fake.nvmlDeviceGetMemoryInfo(handle).used == fake_nvml.MEASURED_IDLE_USED_BYTES


def test_another_namespaces_process_is_not_listed_but_its_memory_is_used():
    fake = FakeNvml([FakeGpu("GPU-a", idle_used_bytes=0)])
    fake.nvmlInit()
    fake.start_process(0, 40 * fake_nvml.GIB, listed_pid=None)
    handle = fake.nvmlDeviceGetHandleByUUID("GPU-a")
    assert fake.nvmlDeviceGetComputeRunningProcesses(handle) == []
    assert fake.nvmlDeviceGetMemoryInfo(handle).used == 40 * fake_nvml.GIB


def test_per_device_errors_mig_and_a_lost_gpu_raise_their_codes():
    gpus = h200s(3)
    gpus[1].errors["nvmlDeviceGetHandleByIndex"] = fake_nvml.NVML_ERROR_NO_PERMISSION
    gpus[2].mig = True
    fake = FakeNvml(gpus)
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 3
    with pytest.raises(fake_nvml.NVMLError_NoPermission):
        fake.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(fake_nvml.NVMLError_NotSupported):
        fake.nvmlDeviceGetUtilizationRates(fake.nvmlDeviceGetHandleByIndex(2))
    fake.lose(0)
    with pytest.raises(fake_nvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetMemoryInfo(fake.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(fake_nvml.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetHandleByIndex(7)


def test_an_idle_gpu_reads_what_the_measured_h200_did_and_v2_splits_the_reservation_out():
    """v1: 615 MiB used of 143,771 MiB with no process (measured); v2: the modelled 512 MiB reserved + 103 MiB used,
    in nvidia-ml-py's c_nvmlMemory_v2_t fields, asked for with its nvmlMemory_v2 version word."""
    real = real_pynvml()
    assert fake_nvml.nvmlMemory_v2 == real.nvmlMemory_v2
    fake = FakeNvml(h200s(1))
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    v1 = fake.nvmlDeviceGetMemoryInfo(handle)
    assert (v1.total, v1.used) == (143771 * fake_nvml.MIB, 615 * fake_nvml.MIB)
    v2 = fake.nvmlDeviceGetMemoryInfo(handle, version=fake.nvmlMemory_v2)
    assert list(vars(v2)) == [name for name, _ in real.c_nvmlMemory_v2_t._fields_]
    assert (v2.reserved, v2.used, v2.free) == (512 * fake_nvml.MIB, 103 * fake_nvml.MIB, v1.free)
    fake.start_process(0, 4 * fake_nvml.GIB, listed_pid=None)
    assert fake.nvmlDeviceGetMemoryInfo(handle, version=fake.nvmlMemory_v2).used == (103 + 4096) * fake_nvml.MIB


@pytest.mark.parametrize("code", [fake_nvml.NVML_ERROR_FUNCTION_NOT_FOUND, fake_nvml.NVML_ERROR_NOT_SUPPORTED])
def test_a_driver_without_the_v2_struct_refuses_it_and_still_answers_v1(code):
    fake = FakeNvml(h200s(1, memory_v2_error=code))
    fake.nvmlInit()
    handle = fake.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(fake_nvml.NVMLError) as refused:
        fake.nvmlDeviceGetMemoryInfo(handle, version=fake.nvmlMemory_v2)
    assert refused.value.value == code
    assert fake.nvmlDeviceGetMemoryInfo(handle).used == 615 * fake_nvml.MIB
    fake.gpus[0].memory_v2_error = None
    with pytest.raises(fake_nvml.NVMLError_ArgumentVersionMismatch):  # a version word this driver does not know
        fake.nvmlDeviceGetMemoryInfo(handle, version=0x03000030)
