"""A worker's training job, planned and checked without TensorFlow: config, TF_CONFIG, manifest and shard split
agree, or a ConfigError says which setting to change, before the worker pays for TensorFlow (trainer/train.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.config import ConfigError, RunConfig
from core.config.pinned import load_pinned_config
from core.layout import TrainOutput
from trainer import runtime
from trainer.data import load_manifest, token_dtype, worker_shards
from trainer.lora_plan import model_shape, plan_lora


@dataclass(frozen=True)
class TrainJob:
    """A checked plan for this worker: what to train, on which shards, where to write."""

    cfg: RunConfig
    manifest: dict[str, Any]
    manifest_url: str
    output: TrainOutput
    identity: runtime.WorkerIdentity
    slot_shards: tuple[tuple[dict[str, Any], ...], ...]  # per micro-step its shards; one group in per-worker order
    slot_order: bool  # True: per-slot data order, identical for every worker/accumulation split

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def is_chief(self) -> bool:
        return self.identity.is_chief

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch_size * self.cfg.block_size


def plan_job(config_url: str, manifest_url: str, output_url: str, environ: dict[str, str] | None = None) -> TrainJob:
    """Validate config, TF_CONFIG and manifest against each other without TensorFlow; raise ConfigError (also when
    the config is not the one the Airflow side pinned: core/config/pinned.py)."""
    return plan_job_for(load_pinned_config(config_url, environ), config_url, manifest_url, output_url, environ)


def plan_job_for(cfg: RunConfig, config_url: str, manifest_url: str, output_url: str,
                 environ: dict[str, str] | None = None) -> TrainJob:
    """`plan_job` for a configuration already loaded (`config_url` only names it in errors)."""
    if cfg.max_steps <= 0:
        raise ConfigError(f"{config_url}: 'max_steps' must be resolved (> 0) before training, got {cfg.max_steps}.")
    identity = runtime.worker_identity(environ)
    where = f"rank {identity.rank} on {identity.host}"
    if identity.num_workers != cfg.num_workers:
        raise ConfigError(
            f"{where}: TF_CONFIG lists {identity.num_workers} workers but the config {config_url} says "
            f"'num_workers' = {cfg.num_workers}: launch as many workers as the config names."
        )
    manifest = load_manifest(manifest_url)
    if manifest["block_size"] != cfg.block_size:
        raise ConfigError(
            f"{where}: the shards of {manifest_url} hold sequences of {manifest['block_size']} tokens but "
            f"'block_size' = {cfg.block_size}: re-prepare the dataset or set 'block_size' to match."
        )
    vocab_size = manifest["tokenizer"]["vocab_size"]
    expected_dtype = token_dtype(vocab_size)
    if manifest["dtype"] != expected_dtype:
        raise ConfigError(
            f"{where}: {manifest_url} stores tokens as {manifest['dtype']} but a vocabulary of {vocab_size} "
            f"needs {expected_dtype}: the manifest is inconsistent, re-prepare the dataset."
        )
    if cfg.adapter == "lora":  # its targets and rank against the model's shape, before TensorFlow
        plan_lora(cfg, model_shape(cfg, vocab_size))
    # Raises naming the counts when there are fewer shards than workers.
    worker_shards(manifest, "train", identity.rank, identity.num_workers)

    micro_steps = cfg.grad_accum_steps
    num_slots = cfg.num_workers * micro_steps
    if len(manifest["splits"]["train"]["shards"]) >= num_slots:
        first = identity.rank * micro_steps
        slots = tuple(
            tuple(worker_shards(manifest, "train", slot, num_slots)) for slot in range(first, first + micro_steps)
        )
        return TrainJob(cfg, manifest, manifest_url, TrainOutput(output_url), identity, slots, True)
    # Too few shards for one per slot: the worker's shards feed all its micro-steps in turn (still a correct
    # run, but its data order differs from a split of the same global batch over other worker counts).
    own = tuple(worker_shards(manifest, "train", identity.rank, identity.num_workers))
    return TrainJob(cfg, manifest, manifest_url, TrainOutput(output_url), identity, (own,), False)
