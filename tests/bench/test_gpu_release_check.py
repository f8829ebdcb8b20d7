"""`bench/gpu_release_check.py --dry-run`: the GPU release check's whole flow (each GPU's idle figures by v1 and v2,
placement refusing a busy GPU, release of a worker that ignores SIGTERM, a GPU used from another PID namespace) on
the fake NVML, so the script keeps working between the rare runs on a GPU host; run without site-packages
(`python -S`), as on a bare host, with only the two libraries the launcher keeps (`LAUNCHER_LIBRARIES`) on its path."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hardware import nvidia_gpus

REPO = Path(__file__).resolve().parents[2]
# What the launcher imports beyond the standard library: psutil (the process table) and pydantic (the records it
# reads), with pydantic's own dependencies. A GPU host runs the check with these on its path and nothing else.
LAUNCHER_LIBRARIES = ("psutil", "pydantic", "pydantic_core", "typing_extensions", "annotated_types",
                      "typing_inspection")


def _only_the_launcher_libraries(folder: Path) -> Path:
    folder.mkdir()
    for name in LAUNCHER_LIBRARIES:
        spec = importlib.util.find_spec(name)
        location = Path(spec.origin)
        source = location.parent if location.name == "__init__.py" else location
        (folder / source.name).symlink_to(source)
    return folder


def test_dry_run_refuses_a_busy_gpu_releases_a_stubborn_worker_and_sees_another_namespace(tmp_path):
    libraries = _only_the_launcher_libraries(tmp_path / "libraries")
    done = subprocess.run([sys.executable, "-S", "-m", "bench.gpu_release_check", "--dry-run"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(libraries)}, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    checks = report["checks"]
    assert report["dry_run"] and report["ok"] and report["wall_s"] < 120
    # Each GPU's idle figures by both memory calls: the fake's model of the measured H200 (v1 615 MiB used).
    for level in report["idle_levels"]:
        assert level["pids"] == [] and level["v1_mib"]["used"] == 615 and level["v1_mib"]["total"] == 143771
        assert level["v2_mib"]["reserved"] + level["v2_mib"]["used"] == 615
    busy = checks["busy_gpu_not_admitted"]
    assert busy["ok"] and busy["placed"] == [] and 0 not in busy["free"] and "GPU 0 (GPU-" in busy["refusal"]
    stubborn = checks["stubborn_worker_released"]
    assert stubborn["clean"] and stubborn["killed"] == stubborn["terminated"] and stubborn["held_by_run"] == []
    assert list(stubborn["idle_mb_recorded"].values()) == [615]  # released once back at the recorded level
    assert 0.09 <= stubborn["free_after_s"] < 1 and stubborn["release_s"] >= stubborn["grace_s"]
    other = checks["other_namespace_not_free"]
    assert other["ok"] and other["listed_inside"] == [] and other["used_mb_inside"] >= 4096
    print(f"\ndry run: {report['wall_s']} s; release of a SIGTERM-ignoring worker {stubborn['release_s']} s, GPU free "
          f"{stubborn['free_after_s']} s after it was ended")


@pytest.mark.skipif(bool(nvidia_gpus()), reason="a GPU machine runs the real check as its own command")
def test_without_a_gpu_the_real_check_says_so_in_its_json():
    done = subprocess.run([sys.executable, "-m", "bench.gpu_release_check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is False and "no GPU to check" in report["error"] and "--dry-run" in report["error"]
