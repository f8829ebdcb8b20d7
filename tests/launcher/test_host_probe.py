"""launcher/host_probe.py: versions by distribution name, NVML started and shut down in one
place, and a host without NVML answered cleanly."""

import sys
import types
from importlib import metadata

import pytest

from launcher import host_probe


def test_versions_are_keyed_by_distribution_name_and_none_when_not_installed():
    versions = host_probe.package_versions((*host_probe.VERSIONED_PACKAGES, "no-such-distribution"))
    assert versions == {**{name: metadata.version(name) for name in host_probe.VERSIONED_PACKAGES},
                        "no-such-distribution": None}
    assert "safetensors" in versions and "tf-keras" not in versions


def fake_pynvml(init_error: str | None = None) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.NVMLError = type("NVMLError", (Exception,), {})
    module.calls = []

    def init():
        module.calls.append("init")
        if init_error:
            raise module.NVMLError(init_error)

    module.nvmlInit, module.nvmlShutdown = init, lambda: module.calls.append("shutdown")
    return module


def test_nvml_is_shut_down_after_the_probe_even_when_it_fails(monkeypatch):
    pynvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", pynvml)
    with pytest.raises(ZeroDivisionError), host_probe.nvml():
        1 / 0  # noqa: B018
    assert pynvml.calls == ["init", "shutdown"]


@pytest.mark.parametrize(("module", "reason"), [(None, "nvidia-ml-py not installed"),
                                                (fake_pynvml("Driver Not Loaded"), "Driver Not Loaded")])
def test_a_host_without_nvml_says_why(monkeypatch, module, reason):
    monkeypatch.setitem(sys.modules, "pynvml", module)  # None: `import pynvml` raises ImportError
    with pytest.raises(host_probe.NvmlUnavailable, match=reason), host_probe.nvml():
        pytest.fail("entered without NVML")
