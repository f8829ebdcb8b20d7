"""A LoRA run's adapter in PEFT's layout, which `peft.PeftModel.from_pretrained(base, directory)` loads on
transformers 5 (PyTorch): `adapter_config.json` (LoraConfig's fields: the base model and its pinned revision, r,
lora_alpha, target_modules, fan_in_fan_out) and `adapter_model.safetensors` (float32 `lora_A` [r, in] and `lora_B`
[out, r] under PEFT's keys `base_model.model.<module>.lora_A.weight`). Published whole, the config last.

The base is named exactly (docs/adapters.md#which-base): a hub model by its name and the commit sha prepare pinned,
a local directory by the sha256 of its config.json and weight files, a preset by its name and seed, a registry
version by its path (versions are never rewritten).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from core import storage
from core.config import RunConfig
from core.layout import ADAPTER_CONFIG, BASE_MODEL_RECORD
from trainer.decoders.safetensors_io import write_file

log = logging.getLogger("trainer.adapter_export")

ADAPTER_WEIGHTS = "adapter_model.safetensors"
FINGERPRINTED = ("config.json", "model.safetensors.index.json")  # and every .safetensors file


def directory_fingerprint(directory: Path) -> str:
    """sha256 over a local checkpoint's config.json and weight files (each one's name and sha256), in name order."""
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.is_file() and (path.name in FINGERPRINTED or path.suffix == ".safetensors"):
            digest.update(f"{path.name}\0{storage.sha256_file(path)}\n".encode())
    return "sha256:" + digest.hexdigest()


def base_identity(cfg: RunConfig) -> dict[str, str]:
    """The base model an adapter of `cfg`'s run needs: `base_model_name_or_path` and `revision`."""
    if cfg.is_preset_model:
        return {"base_model_name_or_path": f"preset:{cfg.model}", "revision": f"seed:{cfg.seed}"}
    record_url = storage.join(cfg.model, BASE_MODEL_RECORD)
    if cfg.model_revision and storage.exists(record_url):  # a hub model prepare pinned and cached
        record = storage.read_json(record_url)
        name, sha = (record.get(key) if isinstance(record, dict) else None for key in ("name", "sha"))
        if not isinstance(name, str) or not isinstance(sha, str):
            raise ValueError(f"{record_url} names no hub model and commit (name {name!r}, sha {sha!r}): the cached "
                             "base is damaged; delete that directory and run prepare again.")
        return {"base_model_name_or_path": name, "revision": sha}
    local = Path(cfg.model.removeprefix("file://")).expanduser()
    if "://" not in cfg.model.removeprefix("file://") and local.is_dir():
        return {"base_model_name_or_path": str(local.resolve()), "revision": directory_fingerprint(local)}
    return {"base_model_name_or_path": cfg.model, "revision": cfg.model_revision or "registry version"}


def adapter_config(plan, base: dict[str, str]) -> dict[str, Any]:
    """adapter_config.json: PEFT's LoraConfig fields for these adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", **base, "r": plan.rank, "lora_alpha": plan.alpha,
        "target_modules": sorted(plan.targets), "fan_in_fan_out": plan.fan_in_fan_out, "lora_dropout": 0.0,
        "bias": "none", "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
    }


def write_adapter(cfg: RunConfig, adapters, url: str) -> dict[str, Any]:
    """Publish `adapters` (trainer/lora.py's LoraAdapters) to `url` in PEFT's layout; returns its config."""
    base = base_identity(cfg)
    config = adapter_config(adapters.plan, base)
    tensors = {name: np.asarray(variable.numpy(), np.float32) for name, variable in adapters.tensors.items()}
    with storage.staging_directory(url) as stage:
        write_file(stage / ADAPTER_WEIGHTS, {name: value.shape for name, value in tensors.items()},
                   tensors.__getitem__, {"format": "pt"})
        storage.publish_directory(stage, url, last=(
            ADAPTER_CONFIG, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()))
    log.info("LoRA adapter (%d tensors, base %s @ %s) written to %s", len(tensors),
             base["base_model_name_or_path"], base["revision"], url)
    return config
