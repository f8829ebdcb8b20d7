"""trainer/host_info.py: one spelling of versions wherever a worker reports them, and clean answers without NVML."""

import platform
import shutil
import socket
import sys
from importlib import metadata

from launcher import gpus
from launcher.host_probe import VERSIONED_PACKAGES
from tests.conftest import REPO
from tests.support.fake_nvml import FakeNvml, h200s, install
from trainer import host_info
from trainer.metrics import GpuSampler


def test_versions_spell_packages_by_distribution_name():
    assert host_info.versions() == {"python": platform.python_version(),
                                    **{name: metadata.version(name) for name in VERSIONED_PACKAGES}}
    assert "tf-keras" in host_info.versions() and "tf_keras" not in host_info.versions()


def test_without_nvml_every_probe_answers_empty(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed: `import pynvml` fails
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert host_info.visible_gpus() == {"nvml": "unavailable (nvidia-ml-py not installed)",
                                        "cuda_visible_devices": "0", "gpus": []}
    sampler = GpuSampler(enabled=True)
    assert sampler.sample() == {} and sampler.name is None and sampler.peak_flops() is None
    assert gpus.probe_gpus().unavailable == "nvidia-ml-py not installed"


def test_the_code_fingerprint_names_the_files_that_differ(tmp_path):
    here = host_info.code_fingerprint()
    assert {"trainer/train.py", "launcher/ssh.py"} <= set(here["files"])
    stale = tmp_path / "old-checkout" / "trainer"
    shutil.copytree(REPO / "trainer", stale, ignore=shutil.ignore_patterns("__pycache__"))
    (stale / "data.py").write_text((stale / "data.py").read_text() + "\n# last week's version\n")
    there = host_info.code_fingerprint({"trainer": [str(stale)], "core": [str(REPO / "core")],
                                        "launcher": [str(REPO / "launcher")]})
    assert there["fingerprint"] != here["fingerprint"]
    assert [name for name in here["files"] if here["files"][name] != there["files"][name]] == ["trainer/data.py"]


def test_visible_gpus_reads_uuid_entries_as_the_launcher_pins_them(monkeypatch):
    fake = install(monkeypatch, FakeNvml(h200s(3)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", fake.gpus[2].uuid)
    report = host_info.visible_gpus()
    assert [(gpu["index"], gpu["uuid"], gpu["name"]) for gpu in report["gpus"]] == [(2, fake.gpus[2].uuid,
                                                                                     "NVIDIA H200")]
    assert "unusable" not in report


def test_a_device_that_does_not_exist_or_is_lost_is_named_with_the_host(monkeypatch):
    fake = install(monkeypatch, FakeNvml(h200s(2)))
    fake.lose(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,1,GPU-not-on-this-host")
    report = host_info.visible_gpus()
    assert report["gpus"] == []
    opened = f"on host {socket.gethostname()}: NVML cannot open it"
    counted = "NVML counts 2 GPU(s) here"
    assert report["unusable"] == [
        f"CUDA_VISIBLE_DEVICES entry '7' {opened} (NVMLError_InvalidArgument: Invalid Argument); {counted}",
        f"CUDA_VISIBLE_DEVICES entry '1' {opened} (NVMLError_GpuIsLost: GPU is lost); {counted}",
        f"CUDA_VISIBLE_DEVICES entry 'GPU-not-on-this-host' {opened} (NVMLError_NotFound: Not Found); {counted}"]
