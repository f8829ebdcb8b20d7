"""Preflight: per-worker checks in-process, then real groups of CPU workers on loopback through the launcher."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import pytest
from tf_multiworker.launcher.protocol import HOST_TMPDIR_ENV

from tests.conftest import REPO
from tests.support.hardware import nvidia_gpus
from trainer import selftest
from trainer.config import RunConfig
from trainer.layout import PreflightOutput
from trainer.runtime import WorkerIdentity
from trainer.storage import read_json

WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def _dataset(root: Path, *, num_workers: int, collective_timeout_s: int = 60) -> dict[str, str]:
    """A manifest with four (dummy) train shards and the run's config.json; returns the selftest's arguments."""
    dataset = root / "datasets" / "fp"
    dataset.mkdir(parents=True)
    shards = []
    for index in range(4):
        name = f"train-{index:05d}-of-00004.tfrecord"
        (dataset / name).write_bytes(b"\0" * 128)
        shards.append({"name": name, "records": 1, "sequences": 1, "tokens": 64, "bytes": 128, "sha256": "-"})
    manifest = {
        "format_version": 1, "fingerprint": "fp", "dtype": "uint16", "block_size": 64, "sequences_per_record": 1,
        "tokenizer": {"spec": "bpe:256", "fingerprint": "t", "vocab_size": 256, "eos_token_id": 0, "path": "tok"},
        "splits": {"train": {"sequences": 4, "tokens": 256, "shards": shards},
                   "validation": {"sequences": 0, "tokens": 0, "shards": []}},
    }
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    cfg = RunConfig(num_workers=num_workers, storage_root=str(root), collective_timeout_s=collective_timeout_s)
    (root / "config.json").write_text(cfg.to_json())
    return {"config": str(root / "config.json"), "manifest": str(dataset / "manifest.json"),
            "output": str(root / "runs" / "r" / "report")}


def _args(paths: dict[str, str]) -> tuple[str, ...]:
    return ("--config", paths["config"], "--manifest", paths["manifest"], "--output", paths["output"])


def _group(paths, num_workers: int, workdir: Path, **env: str):
    from tf_multiworker.launcher import GroupSpec, LocalBackend, WorkerGroup

    lines: list[str] = []
    spec = GroupSpec(name="preflight", entrypoint="trainer.selftest", args=_args(paths), num_workers=num_workers,
                     env={**WORKER_ENV, **env}, startup_timeout_s=120, hang_timeout_s=120)
    result = WorkerGroup(spec, LocalBackend(), workdir, on_line=lambda rank, line: lines.append(line)).run()
    return result, "\n".join(lines)


# -- per-worker checks, no TensorFlow ----------------------------------------------------------------------------

def _identity(rank=0, num_workers=1):
    return WorkerIdentity(rank, num_workers, "host-a", tuple(f"127.0.0.1:{5000 + r}" for r in range(num_workers)))


def test_worker_checks_pass_on_a_good_setup(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU of the machine is visible
    paths = _dataset(tmp_path, num_workers=2)
    cfg = RunConfig.from_saved(read_json(paths["config"]))
    report = selftest.check_worker(cfg, paths["manifest"], _identity(1, 2))
    assert report["errors"] == []
    assert report["manifest"] == {"ok": True, "fingerprint": "fp", "shards": 2, "shard_bytes": 256}
    assert report["storage"]["ok"] and report["disk"]["free_bytes"] > report["disk"]["needed_bytes"]
    installed = {package: metadata.version(package) for package in ("tensorflow", "tf-keras", "transformers", "numpy")}
    assert report["versions"] == {"python": platform.python_version(), **installed}
    assert [(gpu["index"], gpu["name"]) for gpu in report["devices"]["gpus"]] == nvidia_gpus()
    assert not (tmp_path / ".preflight").exists() or not any((tmp_path / ".preflight").iterdir())


def test_worker_checks_name_each_problem_and_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # as the launcher pins a worker given no GPU, on any machine
    paths = _dataset(tmp_path, num_workers=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where storage_root needs a directory: not writable, even by root")
    cfg = RunConfig(num_workers=3, use_gpu=True, storage_root=str(blocker / "root"))
    (Path(paths["manifest"]).parent / "train-00003-of-00004.tfrecord").unlink()
    report = selftest.check_worker(cfg, paths["manifest"], _identity(1, 2))
    errors = "\n".join(report["errors"])
    assert "rank 1 on host-a (127.0.0.1:5001): TF_CONFIG lists 2 workers but num_workers=3" in errors
    assert "use_gpu is true but no GPU is visible" in errors and "set use_gpu to false" in errors
    assert "shard(s) ['train-00003-of-00004.tfrecord'] listed in" in errors
    assert f"rank 1 on host-a (127.0.0.1:5001): cannot write to storage_root {blocker / 'root'}: " in errors
    assert report["storage"]["ok"] is False and blocker.read_text().startswith("a file where")
    missing = selftest.check_worker(cfg, str(tmp_path / "nope.json"), _identity())["errors"]
    assert any("cannot read the manifest" in e and "nope.json" in e for e in missing)


def test_the_disk_check_counts_cached_datasets_no_worker_holds_as_room(tmp_path, monkeypatch):
    from collections import namedtuple

    from trainer.data import shard_cache_root

    monkeypatch.setenv(HOST_TMPDIR_ENV, str(tmp_path / "host-tmp"))
    paths = _dataset(tmp_path, num_workers=2)
    cfg = RunConfig.from_saved(read_json(paths["config"]))
    idle = shard_cache_root() / "another-dataset"
    idle.mkdir(parents=True)
    with open(idle / "train-00000-of-00001.tfrecord", "wb") as shard:
        shard.truncate(1 << 30)  # sparse
    monkeypatch.setattr(shutil, "disk_usage", lambda path: namedtuple("Usage", "total used free")(0, 0, 100 << 20))
    report = selftest.check_worker(cfg, paths["manifest"], _identity(1, 2))
    assert report["errors"] == [] and report["disk"]["reclaimable_bytes"] == 1 << 30
    shutil.rmtree(idle)
    [error] = selftest.check_worker(cfg, paths["manifest"], _identity(1, 2))["errors"]
    assert "has 100 MiB free and 0 MiB of idle cached datasets, shard staging needs about 256 MiB" in error


def test_version_skew_names_package_versions_and_ranks():
    reports = {r: {"versions": {"python": "3.11.7", "tensorflow": v, "tf-keras": "2.21.0", "transformers": "4.57.6",
                                "numpy": "2.1"}} for r, v in enumerate(["2.21.0", "2.20.0", "2.21.0"])}
    assert selftest.version_skew(reports) == [
        ("version skew in tensorflow: 2.21.0 on rank(s) [0, 2]; 2.20.0 on rank(s) [1]. Install the same environment "
         "on every worker (uv sync --frozen from the same uv.lock)")]
    assert selftest.version_skew({0: reports[0], 2: reports[2]}) == []


def test_a_host_with_another_copy_of_the_project_code_is_named_with_the_files_that_differ(tmp_path):
    here = selftest.code_fingerprint()
    assert {"trainer/train.py", "tf_multiworker/launcher/ssh.py"} <= set(here["files"])
    stale = tmp_path / "old-checkout" / "trainer"
    shutil.copytree(REPO / "trainer", stale, ignore=shutil.ignore_patterns("__pycache__"))
    (stale / "data.py").write_text((stale / "data.py").read_text() + "\n# last week's version\n")
    there = selftest.code_fingerprint({"trainer": [str(stale)],
                                       "tf_multiworker": [str(REPO / "plugins" / "tf_multiworker")]})
    assert there["fingerprint"] != here["fingerprint"]
    versions = {"python": "3.11.7", "tensorflow": "2.21.0", "tf-keras": "2.21.0", "transformers": "4.57.6",
                "numpy": "2.1"}
    reports = {0: {"host": "host-a", "versions": versions, "code": here},
               1: {"host": "host-a", "versions": versions, "code": here},
               2: {"host": "host-c", "versions": versions, "code": there}}
    assert selftest.version_skew(reports) == [(
        f"the project's code differs between workers: {here['fingerprint']} on rank(s) [0, 1] (host-a); "
        f"{there['fingerprint']} on rank(s) [2] (host-c); files that differ: trainer/data.py. Deploy the same checkout "
        "of this project on every host (in remote_python's environment there) or the same trainer image")]
    assert selftest.version_skew({0: reports[0], 1: reports[1]}) == []


def test_a_rank_leaves_only_once_every_rank_is_past_its_collectives(tmp_path):
    """No rank may exit while a peer could still read its last collective's data (see wait_for_every_rank): a
    report from the checks only, or one from an earlier attempt, does not count."""
    import threading

    output, me = str(tmp_path / "report"), _identity(1, 3)
    earlier_attempt = WorkerIdentity(0, 3, "host-a", ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"))
    this_attempt = selftest.group_id(me)
    selftest.storage.write_json_atomic(PreflightOutput(output).rank_report(0), {"group_id": this_attempt})
    selftest.storage.write_json_atomic(PreflightOutput(output).rank_report(2),
                                       {"group_id": selftest.group_id(earlier_attempt), "collectives": {}})
    waiter = threading.Thread(target=selftest.wait_for_every_rank, args=(output, me), daemon=True)
    waiter.start()
    for rank in (0, 2):
        waiter.join(0.5)
        assert waiter.is_alive(), f"left before rank {rank} finished its collectives"
        selftest.storage.write_json_atomic(PreflightOutput(output).rank_report(rank),
                                           {"group_id": this_attempt, "collectives": {}})
    waiter.join(5)
    assert not waiter.is_alive()


def non_loopback_addresses() -> list[str]:
    import ipaddress

    import psutil

    return [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family in (socket.AF_INET, socket.AF_INET6)
            and not (ip := ipaddress.ip_address(a.address.split("%")[0])).is_loopback and not ip.is_link_local]


@pytest.mark.parametrize("bind, exposed", [("127.0.0.1", False), ("0.0.0.0", True)])
def test_port_exposure_tells_loopback_from_all_interfaces(bind, exposed):
    if exposed and not non_loopback_addresses():
        pytest.skip("this host has no non-loopback address to reach")
    with socket.socket() as server:
        server.bind((bind, 0))
        server.listen()
        port = server.getsockname()[1]
        identity = WorkerIdentity(0, 2, "host-a", (f"127.0.0.1:{port}", "127.0.0.1:1"))
        result = selftest.port_exposure(identity)
    assert result["port"] == port and result["checked"] == non_loopback_addresses()
    assert result["exposed"] is exposed and bool(result["reachable_on"]) is exposed
    lines = selftest.port_lines({"workers": [{"rank": 0, "host": "host-a", "worker_port": result}]})
    assert lines[0].startswith("WARNING: rank 0 on host-a: worker port") is exposed


# -- real groups -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers", [2, 3])
def test_cpu_workers_on_loopback_pass_with_exact_collectives_and_figures(tmp_path, num_workers):
    paths = _dataset(tmp_path, num_workers=num_workers)
    result, log = _group(paths, num_workers, tmp_path / "work")
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
    assert all(port["checked"] == non_loopback_addresses() for port in ports)
    assert all(port["exposed"] == bool(port["checked"]) for port in ports)  # TF binds 0.0.0.0, never loopback only
    assert all((f"WARNING: rank {r} on" in log) == bool(ports[r]["checked"]) for r in range(num_workers))
    print("\n" + "\n".join(line for line in log.splitlines() if "PREFLIGHT" in line or "bandwidth" in line))


def test_version_skew_fails_the_group(tmp_path):
    paths = _dataset(tmp_path, num_workers=2)
    result, _ = _group(paths, 2, tmp_path / "work", GPT_FINETUNE_SELFTEST_FAKE_TF_VERSION="1:2.20.0")
    assert not result.succeeded and result.failures[0].exit_code == selftest.EXIT_CHECKS_FAILED
    report = read_json(paths["output"] + "/preflight.json")
    assert report["status"] == "failed"
    assert report["errors"] and all(e.startswith("version skew in tensorflow") for e in report["errors"])
    assert "2.20.0 on rank(s) [1]" in result.error_message()


def test_a_peer_that_never_starts_fails_within_the_timeout_naming_its_rank(tmp_path):
    """Rank 0 alone, its TF_CONFIG naming rank 1 at a closed port (a worker that never started)."""
    timeout_s = 8
    paths = _dataset(tmp_path, num_workers=2, collective_timeout_s=timeout_s)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        own = sock.getsockname()[1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    tf_config = {"cluster": {"worker": [f"127.0.0.1:{own}", f"127.0.0.1:{closed}"]},
                 "task": {"type": "worker", "index": 0}}
    env = {**os.environ, **WORKER_ENV, "TF_CONFIG": json.dumps(tf_config), "CUDA_VISIBLE_DEVICES": ""}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trainer.selftest", *_args(paths)], env=env, cwd=tempfile.gettempdir(),
                          capture_output=True, text=True, timeout=180, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == selftest.EXIT_COLLECTIVES_FAILED, done.stderr[-2000:]
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


def test_live_values_carry_bandwidth_latency_and_the_advisors_row_for_the_asked_workers():
    result = {"num_workers": 2,
              "collectives": {"bandwidth": {"busbw_gbps": 0.5}, "latency": {"p50_ms": 0.3}},
              "advisor": {"rows": [{"num_workers": n, "speedup": s, "efficiency": s / n, "tokens_per_s": 1000 * s}
                                   for n, s in ((1, 1.0), (2, 1.5))]}}
    assert selftest.live_values(result) == {"busbw_gbps": 0.5, "latency_p50_ms": 0.3, "predicted_speedup": 1.5,
                                            "predicted_efficiency": 0.75, "predicted_tokens_per_s": 1500.0}
    assert selftest.live_values({"num_workers": 1, "collectives": None}) == {}
