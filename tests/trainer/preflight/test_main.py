"""python -m trainer.preflight: real groups of CPU workers on loopback through the launcher, and a rank alone whose
peer never starts."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from core.storage import read_json
from tests.trainer.preflight import workers
from trainer.preflight import verdict

# -- real groups -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [2, 3])
def test_cpu_workers_on_loopback_pass_with_exact_collectives_and_figures(tmp_path, num_workers):
    paths = workers.dataset(tmp_path, num_workers=num_workers)
    result, log = workers.group(paths, num_workers, tmp_path / "work")
    assert result.succeeded, result.error_message()
    report = read_json(paths["output"] + "/preflight.json")
    assert report["status"] == "passed" and report["errors"] == []
    assert [w["rank"] for w in report["workers"]] == list(range(num_workers))
    collectives = report["collectives"]
    assert collectives["all_reduce"]["got"] == [float(r + 1) for r in range(num_workers)]
    assert collectives["broadcast"]["ok"] and collectives["broadcast"]["got"] == [100.0, 101.0, 102.0, 103.0]
    bandwidth = collectives["bandwidth"]
    assert bandwidth["algbw_gbps"] > 0 and bandwidth["ok"]
    assert bandwidth["busbw_gbps"] == pytest.approx(bandwidth["algbw_gbps"] * 2 * (num_workers - 1) / num_workers)
    assert collectives["latency"]["p50_ms"] > 0
    assert f"PREFLIGHT PASSED: {num_workers} worker(s)" in log and "busbw" in log and "latency (4 B) p50" in log
    # TF's server listens on every interface: each worker reports whether its port answers off loopback.
    ports = [worker["worker_port"] for worker in report["workers"]]
    assert len({port["port"] for port in ports}) == num_workers
    assert all(port["checked"] == workers.non_loopback_addresses() for port in ports)
    assert all(port["exposed"] == bool(port["checked"]) for port in ports)  # TF binds 0.0.0.0, never loopback only
    assert all((f"WARNING: rank {r} on" in log) == bool(ports[r]["checked"]) for r in range(num_workers))
    print("\n" + "\n".join(line for line in log.splitlines() if "PREFLIGHT" in line or "bandwidth" in line))


def test_version_skew_fails_the_group(tmp_path):
    paths = workers.dataset(tmp_path, num_workers=2)
    result, _ = workers.group(paths, 2, tmp_path / "work", GPT_FINETUNE_PREFLIGHT_FAKE_TF_VERSION="1:2.20.0")
    assert not result.succeeded and result.failures[0].exit_code == verdict.EXIT_CHECKS_FAILED
    report = read_json(paths["output"] + "/preflight.json")
    assert report["status"] == "failed"
    assert report["errors"] and all(e.startswith("version skew in tensorflow") for e in report["errors"])
    assert "2.20.0 on rank(s) [1]" in result.error_message()


def test_a_peer_that_never_starts_fails_within_the_timeout_naming_its_rank(tmp_path):
    """Rank 0 alone, its TF_CONFIG naming rank 1 at a closed port (a worker that never started)."""
    timeout_s = 8
    paths = workers.dataset(tmp_path, num_workers=2, collective_timeout_s=timeout_s)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        own = sock.getsockname()[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{own}", f"127.0.0.1:{closed}"]},
                 "task": {"type": "worker", "index": 0}}
    env = {**os.environ, **workers.WORKER_ENV, "TF_CONFIG": json.dumps(tf_config), "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trainer.preflight", *workers.args(paths)], env=env,
                          cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=180, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == verdict.EXIT_COLLECTIVES_FAILED, done.stderr[-2000:]
    report = read_json(paths["output"] + "/preflight.json")
    print(f"\nnever-started peer: exit {done.returncode}, failed {report['failed_after_s']:.1f} s after the "
          f"rendezvous began (collective_timeout_s={timeout_s}), process wall time {elapsed:.1f} s")
    assert report["failed_after_s"] >= timeout_s
    assert report["status"] == "failed" and report["answered"] == [0] and report["missing"] == [1]
    assert report["probes"]["1"].startswith("connection refused")
    message = report["errors"][0]
    assert message.startswith("collectives failed during rendezvous") and f"collective_timeout_s={timeout_s}" in message
    assert f"rank 1 at 127.0.0.1:{closed}: connection refused" in message and "ranks that did not: [1]" in message
    assert "PREFLIGHT FAILED" in done.stdout
