"""trainer/host_info.py: one spelling of versions wherever a worker reports them, and clean answers without NVML."""

import platform
import shutil
import sys
from importlib import metadata

from launcher import local
from launcher.host_probe import VERSIONED_PACKAGES
from tests.conftest import REPO
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
    assert local.gpu_processes() is None and local.free_gpus() == []


def test_the_code_fingerprint_names_the_files_that_differ(tmp_path):
    here = host_info.code_fingerprint()
    assert {"trainer/train.py", "launcher/ssh.py"} <= set(here["files"])
    stale = tmp_path / "old-checkout" / "trainer"
    shutil.copytree(REPO / "trainer", stale, ignore=shutil.ignore_patterns("__pycache__"))
    (stale / "data.py").write_text((stale / "data.py").read_text() + "\n# last week's version\n")
    there = host_info.code_fingerprint({"trainer": [str(stale)],
                                        "launcher": [str(REPO / "launcher")]})
    assert there["fingerprint"] != here["fingerprint"]
    assert [name for name in here["files"] if here["files"][name] != there["files"][name]] == ["trainer/data.py"]
