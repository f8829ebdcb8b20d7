"""A preflight's inputs on local disk, worker identities, and groups of real preflight workers on loopback."""

from __future__ import annotations

import ipaddress
import json
import socket
from pathlib import Path

import psutil

from core.config import RunConfig
from trainer.runtime import WorkerIdentity

WORKER_ENV = {"TF_CPP_MIN_LOG_LEVEL": "3"}
FINGERPRINT = "0f" * 10


def dataset(root: Path, *, num_workers: int, collective_timeout_s: int = 60) -> dict[str, str]:
    """A manifest with four (dummy) train shards and the run's config.json; returns the preflight's arguments."""
    directory = root / "datasets" / FINGERPRINT
    directory.mkdir(parents=True)
    shards = []
    for index in range(4):
        name = f"train-{index:05d}-of-00004.tfrecord"
        (directory / name).write_bytes(b"\0" * 128)
        shards.append({"name": name, "records": 1, "sequences": 1, "tokens": 64, "bytes": 128, "sha256": "-"})
    manifest = {
        "format_version": 1, "fingerprint": FINGERPRINT, "dtype": "uint16", "block_size": 64, "sequences_per_record": 1,
        "tokenizer": {"spec": "bpe:256", "fingerprint": "t", "vocab_size": 256, "eos_token_id": 0,
                      "path": "tokenizer"},
        "splits": {"train": {"sequences": 4, "tokens": 256, "shards": shards},
                   "validation": {"sequences": 0, "tokens": 0, "shards": []}},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))
    cfg = RunConfig(num_workers=num_workers, storage_root=str(root), collective_timeout_s=collective_timeout_s)
    (root / "config.json").write_text(cfg.to_json())
    return {"config": str(root / "config.json"), "manifest": str(directory / "manifest.json"),
            "output": str(root / "runs" / "r" / "report")}


def args(paths: dict[str, str]) -> tuple[str, ...]:
    return ("--config", paths["config"], "--manifest", paths["manifest"], "--output", paths["output"])


def group(paths, num_workers: int, workdir: Path, **env: str):
    from launcher import GroupSpec, LocalBackend, WorkerGroup

    lines: list[str] = []
    spec = GroupSpec(name="preflight", entrypoint="trainer.preflight", args=args(paths), num_workers=num_workers,
                     env={**WORKER_ENV, **env}, startup_timeout_s=120, hang_timeout_s=120)
    result = WorkerGroup(spec, LocalBackend(), workdir, on_line=lambda rank, line: lines.append(line)).run()
    return result, "\n".join(lines)


def identity(rank=0, num_workers=1):
    return WorkerIdentity(rank, num_workers, "host-a", tuple(f"127.0.0.1:{5000 + r}" for r in range(num_workers)))


def non_loopback_addresses() -> list[str]:
    return [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family in (socket.AF_INET, socket.AF_INET6)
            and not (ip := ipaddress.ip_address(a.address.split("%")[0])).is_loopback and not ip.is_link_local]
