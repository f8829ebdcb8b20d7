"""What one worker can check alone, before any TensorFlow: problems go to `errors`, each naming the setting to
change."""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any

from core import storage
from core.config import RunConfig
from trainer import host_info, runtime

# Tests only: "<rank>:<version>" makes that rank report another TensorFlow version (a simulated skew).
FAKE_TF_VERSION_ENV = "GPT_FINETUNE_PREFLIGHT_FAKE_TF_VERSION"


def package_versions(rank: int) -> dict[str, str | None]:
    versions = host_info.versions()
    fake = os.environ.get(FAKE_TF_VERSION_ENV, "")
    if fake and int(fake.split(":", 1)[0]) == rank:
        versions["tensorflow"] = fake.split(":", 1)[1]
    return versions


def check_worker(cfg: RunConfig, manifest_url: str, identity: runtime.WorkerIdentity) -> dict[str, Any]:
    """Everything one worker can check alone. Problems go to `errors`, each naming the setting to change."""
    from trainer import shard_cache
    from trainer.data import DataError, load_manifest, shard_cache_root, worker_shards

    errors: list[str] = []
    # The address its peers reach it at (TF_CONFIG) tells hosts apart where hostnames repeat (containers, VMs).
    address = identity.addresses[identity.rank] if identity.addresses else None
    where = f"rank {identity.rank} on {identity.host}" + (f" ({address})" if address else "")
    report: dict[str, Any] = {"rank": identity.rank, "host": identity.host, "address": address, "pid": os.getpid(),
                              "versions": package_versions(identity.rank), "code": host_info.code_fingerprint(),
                              "devices": host_info.visible_gpus()}
    if identity.num_workers != cfg.num_workers:
        errors.append(f"{where}: TF_CONFIG lists {identity.num_workers} workers but num_workers={cfg.num_workers}: "
                      "the launcher and the run configuration disagree")
    errors += [f"{where}: {problem}: run nvidia-smi on that host (a lost GPU needs a reset)" for problem in
               report["devices"].get("unusable", ())]
    if cfg.use_gpu and not report["devices"]["gpus"]:
        errors.append(f"{where}: use_gpu is true but no GPU is visible (NVML: {report['devices']['nvml']}, "
                      f"CUDA_VISIBLE_DEVICES={report['devices']['cuda_visible_devices']!r}): set use_gpu to false or "
                      "run on a machine with free GPUs")

    shard_bytes = 0
    try:
        manifest = load_manifest(manifest_url)
        shards = worker_shards(manifest, "train", identity.rank, identity.num_workers)
        shard_bytes = sum(shard["bytes"] for shard in shards)
        base = manifest_url.rstrip("/").rsplit("/", 1)[0]
        absent = [s["name"] for s in shards if not storage.exists(storage.join(base, s["name"]))]
        if absent:
            errors.append(
                f"{where}: shard(s) {absent} listed in {manifest_url} do not exist: prepare the dataset again")
        report["manifest"] = {"ok": not absent, "fingerprint": manifest["fingerprint"], "shards": len(shards),
                              "shard_bytes": shard_bytes}
    except (DataError, OSError, ValueError, KeyError) as error:
        errors.append(f"{where}: cannot read the manifest {manifest_url}: {error}")
        report["manifest"] = {"ok": False, "error": str(error)}

    if report["manifest"]["ok"]:
        report["memory"] = check_memory(cfg, manifest, report["devices"], where, errors)

    cache = shard_cache_root()
    staging = runtime.host_temp_dir()  # where the shard cache lies
    fingerprint = report["manifest"].get("fingerprint", "")
    missing = shard_cache.missing_bytes(cache / fingerprint, shards) if fingerprint else shard_bytes
    free = shutil.disk_usage(staging).free
    needed = shard_cache.room_for(missing)
    report["disk"] = {"path": staging, "free_bytes": free, "needed_bytes": needed}
    if free < needed:  # training would first evict the datasets no worker holds
        report["disk"]["reclaimable_bytes"] = reclaimable = shard_cache.reclaimable_bytes(cache, keep=fingerprint)
        if free + reclaimable < needed:
            errors.append(f"{where}: {staging} has {free >> 20} MiB free and {reclaimable >> 20} MiB of idle cached "
                          f"datasets, shard staging needs about {needed >> 20} MiB: free disk space or point TMPDIR "
                          "at a larger disk")

    probe = storage.join(cfg.storage_root, ".preflight", f"{identity.host}-rank{identity.rank}-{uuid.uuid4().hex}")
    try:
        storage.write_bytes_atomic(probe, b"preflight")
        storage.remove_tree(probe)
        report["storage"] = {"ok": True, "root": cfg.storage_root}
    except Exception as error:  # noqa: BLE001 - any backend error means the same: training could not save
        errors.append(f"{where}: cannot write to storage_root {cfg.storage_root}: {type(error).__name__}: {error}. "
                      "Check storage_root and the storage connection's credentials")
        report["storage"] = {"ok": False, "root": cfg.storage_root, "error": str(error)}
    report["errors"] = errors
    return report


def check_memory(cfg: RunConfig, manifest: dict[str, Any], devices: dict[str, Any], where: str,
                 errors: list[str]) -> dict[str, Any]:
    """The memory forecast of this worker (trainer/memory_forecast.py) against its GPU's free memory, less a CUDA
    context's; a run that cannot fit, or whose LoRA settings the model refuses, goes to `errors`."""
    from trainer.lora_plan import model_shape
    from trainer.memory_forecast import CUDA_CONTEXT_MB, fit_error, run_forecast

    try:
        predicted = run_forecast(cfg, model_shape(cfg, manifest["tokenizer"]["vocab_size"]))
    except (ValueError, OSError) as error:  # ConfigError and CheckpointError are ValueErrors
        errors.append(f"{where}: {error}")
        return {"error": str(error)}
    memory: dict[str, Any] = {"forecast_mb": predicted.as_mib()}
    if cfg.use_gpu and devices["gpus"]:
        free_mb = devices["gpus"][0]["memory_free_mb"] - CUDA_CONTEXT_MB  # the GPU TensorFlow will use
        memory["gpu_free_mb"] = free_mb
        problem = fit_error(cfg, predicted, free_mb, where)
        if problem:
            errors.append(problem)
    return memory
