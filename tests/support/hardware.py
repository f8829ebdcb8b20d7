"""What the machine under test has, asked of the driver's own tool rather than assumed: tests expect what is there."""

from __future__ import annotations

import shutil
import subprocess


def nvidia_gpus() -> list[tuple[int, str]]:
    """(index, name) of every GPU NVIDIA's driver lists here (nvidia-smi); [] on a machine without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    listed = subprocess.run([smi, "--query-gpu=index,name", "--format=csv,noheader"], capture_output=True, text=True,
                            timeout=60, check=False)
    if listed.returncode != 0:  # a tool without a working driver
        return []
    rows = (line.split(",", 1) for line in listed.stdout.splitlines() if line.strip())
    return [(int(index), name.strip()) for index, name in rows]


def assert_gpu_check_matches_this_machine(gpu_check: dict) -> None:
    """A release's NVML check: every GPU of the machine inspected, none held by the run and none NVML could not
    vouch for, or, without a GPU, nothing to verify."""
    gpus = nvidia_gpus()
    if not gpus:
        assert gpu_check["nvml"] is False and "no GPU to verify" in gpu_check["note"], gpu_check
        return
    assert gpu_check["nvml"] is True and gpu_check["held_by_run"] == gpu_check["unverified"] == [], gpu_check
    assert [device["gpu"] for device in gpu_check["devices"]] == [index for index, _ in gpus], gpu_check
