"""The prepare task: validate the run settings once, tokenize (or reuse) the dataset, lay out the run.

Everything later tasks need travels in the small dict returned here (XCom): paths and a few numbers, never data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tasks.connections import uses_run_storage
from trainer.config import ConfigError, RunConfig
from trainer.layout import StorageLayout, run_key
from trainer.storage import normalize_root, write_json_atomic

log = logging.getLogger("gpt_finetune.prepare")

REPO_ROOT = Path(__file__).resolve().parents[1]


def build_config(params: Mapping[str, Any]) -> RunConfig:
    """Params (UI form or --conf) -> the validated config, with `storage_root` made absolute."""
    cfg = RunConfig.from_params(dict(params))
    return cfg.replace(storage_root=normalize_root(cfg.storage_root, relative_to=REPO_ROOT))


@uses_run_storage
def prepare_run(params: Mapping[str, Any], run_id: str, dag_id: str) -> dict[str, Any]:
    started = time.perf_counter()  # the stage's figures count its imports below too
    from airflow.sdk.exceptions import AirflowFailException
    from tf_multiworker.launcher import LaunchError
    from tf_multiworker.registry import make_backend

    from tasks.baseline import baseline_key
    from tasks.promote import resolve_promoted_model
    from tasks.queues import report_gpu_queue
    from tasks.tokenize import prepare_dataset
    from trainer.data import load_manifest

    try:
        cfg, continued_from = resolve_promoted_model(build_config(params))
        # The backend's connections exist and are of the right type (nothing is contacted yet).
        make_backend(cfg.backend, cfg.to_dict()).close()
    except (ConfigError, LaunchError) as exc:  # bad settings do not get better on retry: fail now
        raise AirflowFailException(str(exc)) from exc
    log.info("Run configuration (validated):\n  %s", "\n  ".join(cfg.summary_lines()))
    report_gpu_queue(cfg)

    dataset = prepare_dataset(cfg, started=started)
    manifest = load_manifest(dataset.manifest_url)
    total_steps = cfg.steps_for(dataset.train_sequences)
    run_cfg = cfg.replace(max_steps=total_steps, warmup_steps=min(cfg.warmup_steps, total_steps - 1))
    baseline_cfg = run_cfg.baseline_config()

    storage = StorageLayout(cfg.storage_root)
    key = run_key(dag_id, run_id)
    run = storage.run(key)
    base_key = baseline_key(run_cfg, manifest, total_steps)
    baseline = storage.baseline(base_key)
    baseline_config_url = run.baseline_config
    write_json_atomic(run.config, run_cfg.to_dict())
    write_json_atomic(baseline_config_url, baseline_cfg.to_dict())

    log.info(
        "Dataset %s (%s): %d train / %d validation sequences; %d optimizer steps of %d sequences; run dir %s",
        dataset.fingerprint, "cache hit" if dataset.cache_hit else "tokenized", dataset.train_sequences,
        dataset.validation_sequences, total_steps, cfg.global_batch_size, run.url,
    )
    return {
        "run_id": run_id,
        "run_key": key,
        "storage_root": cfg.storage_root,
        "config": run_cfg.to_dict(),
        "config_url": run.config,
        "manifest_url": dataset.manifest_url,
        "dataset_fingerprint": dataset.fingerprint,
        "total_steps": total_steps,
        "preflight_url": run.report,
        "train_url": run.train.url,
        "train_summary_url": run.train.summary,
        "baseline_key": base_key,
        "baseline_url": baseline.url,
        "baseline_config_url": baseline_config_url,
        "baseline_summary_url": baseline.summary,
        "report_url": run.report,
        "continued_from": continued_from,
    }
