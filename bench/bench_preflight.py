"""Preflight cost and what it measures: wall time of `trainer.preflight` on 2 CPU workers through the launcher,
and its all-reduce bus bandwidth next to this machine's memory-copy bandwidth (numpy), the limit on loopback
where every byte of a ring all-reduce is copied through memory and the TCP stack."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

NUM_WORKERS = 2
COPY_BYTES = 256 << 20
COPY_REPEATS = 5


def memory_copy_gbps() -> float:
    """Best of a few numpy copies of a 256 MiB buffer (bytes copied per second)."""
    source = np.ones(COPY_BYTES // 8, dtype=np.float64)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(COPY_REPEATS):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return COPY_BYTES / best / 1e9


def _inputs(root: Path) -> tuple[str, ...]:
    """A run config and a manifest with dummy shards: the preflight reads the manifest, not the tokens."""
    from core.config import RunConfig

    fingerprint = "be" * 10  # a dataset's name as prepare writes it (core.layout.DATASET_FINGERPRINT)
    dataset = root / "datasets" / fingerprint
    dataset.mkdir(parents=True)
    shards = []
    for index in range(NUM_WORKERS):
        name = f"train-{index:05d}-of-{NUM_WORKERS:05d}.tfrecord"
        (dataset / name).write_bytes(b"\0" * 128)
        shards.append({"name": name, "records": 1, "sequences": 1, "tokens": 64, "bytes": 128, "sha256": "-"})
    manifest = {"format_version": 1, "fingerprint": fingerprint, "dtype": "uint16", "block_size": 64,
                "sequences_per_record": 1,
                "tokenizer": {"spec": "bpe:256", "fingerprint": "-", "vocab_size": 256, "eos_token_id": 0,
                              "path": "tokenizer"},
                "splits": {"train": {"sequences": NUM_WORKERS, "tokens": 64 * NUM_WORKERS, "shards": shards},
                           "validation": {"sequences": 0, "tokens": 0, "shards": []}}}
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    (root / "config.json").write_text(RunConfig(num_workers=NUM_WORKERS, storage_root=str(root)).to_json())
    return ("--config", str(root / "config.json"), "--manifest", str(dataset / "manifest.json"),
            "--output", str(root / "report"))


def run(out_dir: Path) -> dict:
    from core.storage import read_json
    from launcher import GroupSpec, LocalBackend, WorkerGroup

    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        root = Path(tmp)
        spec = GroupSpec(name="preflight", entrypoint="trainer.preflight", args=_inputs(root), num_workers=NUM_WORKERS,
                         env={"TF_CPP_MIN_LOG_LEVEL": "3"}, startup_timeout_s=180, hang_timeout_s=180)
        started = time.monotonic()
        result = WorkerGroup(spec, LocalBackend(), root / "work", on_line=lambda rank, line: None).run()
        wall_s = time.monotonic() - started
        if not result.succeeded:
            raise RuntimeError(result.error_message())
        report = read_json(str(root / "report" / "preflight.json"))
    bandwidth, latency = report["collectives"]["bandwidth"], report["collectives"]["latency"]
    copy_gbps = memory_copy_gbps()
    print(f"preflight, {NUM_WORKERS} CPU workers on loopback: {wall_s:.1f} s wall (launch to exit; "
          f"{report['wall_time_s']:.1f} s inside the chief)")
    print(f"all-reduce {bandwidth['bytes'] >> 20} MiB: algbw {bandwidth['algbw_gbps']:.3f} GB/s, "
          f"busbw {bandwidth['busbw_gbps']:.3f} GB/s; latency (4 B) p50 {latency['p50_ms']:.2f} ms")
    print(f"memory copy (numpy, {COPY_BYTES >> 20} MiB): {copy_gbps:.2f} GB/s -> busbw is "
          f"{bandwidth['busbw_gbps'] / copy_gbps:.1%} of it")
    return {"num_workers": NUM_WORKERS, "wall_time_s": wall_s, "chief_wall_time_s": report["wall_time_s"],
            "algbw_gbps": bandwidth["algbw_gbps"], "busbw_gbps": bandwidth["busbw_gbps"],
            "latency_p50_ms": latency["p50_ms"], "memory_copy_gbps": copy_gbps,
            "busbw_over_memory_copy": bandwidth["busbw_gbps"] / copy_gbps,
            "rows": [{"benchmark": f"preflight: {NUM_WORKERS} workers, wall time; {bandwidth['bytes'] >> 20} MiB "
                                   "all-reduce bus bandwidth vs numpy memory copy",
                      "measured": f"{wall_s:.1f} s; {bandwidth['busbw_gbps']:.2f} vs {copy_gbps:.1f} GB/s "
                                  f"({bandwidth['busbw_gbps'] / copy_gbps:.1%})", "target": "reported"}]}
