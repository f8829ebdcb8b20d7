"""`bench/gpu_check.py --dry-run`: the GPU check's whole path (prepare, trainer, all-reduce probe, report) on CPU
with tiny shapes, so the script keeps working between the rare runs on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.hardware import nvidia_gpus

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_trains_probes_the_all_reduce_and_reports(tmp_path):
    out = tmp_path / "figures.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--dry-run", "--json", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["dry_run"] and figures["model"] == "tiny" and figures["steps"] == 4
    assert figures["tokens_per_s"] > 0 and figures["first_step_s"] > 0 and figures["final_loss"] > 0
    assert figures["mfu"] is None and figures["peak_gpu_memory_mb"] is None  # CPU: nothing to divide by
    reduce = figures["allreduce"]
    assert (reduce["workers"], reduce["device"], reduce["implementation"]) == (2, "CPU", "RING")
    assert reduce["busbw_gbps"] > 0 and reduce["busbw_gbps"] == reduce["algbw_gbps"]  # 2(N-1)/N = 1 for N = 2
    assert "DRY RUN on CPU" in done.stdout and "MFU n/a" in done.stdout


@pytest.mark.skipif(bool(nvidia_gpus()), reason="a GPU machine runs the real check as its own command")
def test_without_a_gpu_the_real_check_refuses_and_names_the_dry_run():
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "nvidia-smi lists 0 (none)" in done.stdout and "--dry-run" in done.stdout
