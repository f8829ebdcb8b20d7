"""Exact elastic recovery: the train task continues on fewer workers with more accumulation, same global batch.

The trainer's data order is defined per slot of the global batch (`trainer/train.py`): any split of the same
`num_workers x grad_accum_steps` slots over N' workers x (slots / N') micro-steps reads the same sequences at every
step and follows the same loss curve, and checkpoints hold no per-worker state. So when the backend finds fewer
workers usable (`Backend.capacity`: an SSH host unreachable or without free GPUs, fewer free local GPUs, the local
cap `TFMW_LOCAL_USABLE_WORKERS`), `ElasticTrainOperator` launches the largest exact count N' >= `min_workers` that
fits, with a config of N' workers written next to the run's (its digest pinned on the workers in place of the
run's: core/config/pinned.py), and the trainer resumes from the last checkpoint at the exact step and data
position.

Every launch is recorded in the training output's `segments.json` (the report shows each segment with its steps,
workers and tokens/s) and logged as "continued on 2 of 4 workers from step 20: host h unreachable".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from core.clock import utc_now
from core.config import ConfigError, RunConfig
from core.config.pinned import save_config
from core.layout import TrainOutput
from core.protocol import CONFIG_SHA256_ENV
from core.storage import exists, join, read_json, write_json_atomic
from launcher import GroupSpec, LaunchError
from launcher.backend import Backend, Capacity
from launcher.group import end_earlier_attempts
from tf_multiworker.operator import TFMultiWorkerOperator
from trainer.checkpoint import latest_step


def choose_count(cfg: RunConfig, capacity: Capacity) -> int:
    """The largest exact worker count from `num_workers` down to `min_workers` that `capacity` allows."""
    fitting = [count for count in cfg.elastic_worker_counts if count <= capacity.workers]
    if fitting:
        return fitting[0]
    why = "; ".join(capacity.reasons) or "placement found fewer workers"
    raise LaunchError(
        f"only {capacity.workers} of {cfg.num_workers} workers are usable ({why}), below 'min_workers' = "
        f"{cfg.lowest_worker_count}: exact worker counts for this run are {cfg.elastic_worker_counts}. Bring the "
        "hosts/GPUs back, or lower 'min_workers' to a count that splits the global batch exactly.")


class ElasticTrainOperator(TFMultiWorkerOperator):
    """`TFMultiWorkerOperator` for `trainer.train` that launches on fewer workers when fewer are usable.

    Reads `min_workers` and the rest of the run's settings from its `config` (loaded once), and the trainer's files
    from `config_url` and `output_url`, both required. Off (`min_workers` unset or equal to `num_workers`) it
    launches as its parent does, and still records the launch in `segments.json`.
    """

    def plan_group(self, context: Any, spec: GroupSpec, backend: Backend) -> GroupSpec:
        if not self.config_url or not self.output_url:
            raise LaunchError(f"the elastic train task needs config_url and output_url (the trainer's --config and "
                              f"--output), got {self.config_url!r} and {self.output_url!r}")
        cfg, config_url, output = self.config, self.config_url, TrainOutput(self.output_url)
        capacity = Capacity(cfg.num_workers)
        if cfg.lowest_worker_count < cfg.num_workers:
            if spec.run_key:  # an earlier attempt's orphans hold GPUs until ended: end them before counting
                end_earlier_attempts(spec, backend)
            capacity = backend.capacity(spec)  # the backend now places only on what it found usable
        count = choose_count(cfg, capacity)
        reasons = capacity.reasons
        with self.hook.applied():
            step = latest_step(output.checkpoints)
            segments = read_json(output.segments) if exists(output.segments) else {"launches": []}
            if count < cfg.num_workers:
                try:
                    smaller = cfg.for_workers(count, **capacity.settings)
                except ConfigError as error:
                    raise LaunchError(f"cannot continue on {count} workers: {error}") from None
                config_url = join(output.url, f"config-{count}-workers.json")
                # Pinned like prepare's: the workers refuse this file if it changes before they read it.
                pinned = {**spec.env, CONFIG_SHA256_ENV: save_config(config_url, smaller)}
                spec = replace(spec, num_workers=count, args=self.worker_args(config_url), env=pinned)
                self.log.warning(
                    "continued on %d of %d workers from step %d: %s; %d accumulation steps per worker keep the "
                    "global batch at %d sequences and every slot's data order (config %s)", count,
                    cfg.num_workers, step, "; ".join(reasons), smaller.grad_accum_steps, cfg.global_batch_size,
                    config_url)
            launch = {
                "try_number": context["ti"].try_number, "from_step": step, "num_workers": count,
                "grad_accum_steps": cfg.num_workers * cfg.grad_accum_steps // count, "config_url": config_url,
                "reason": "; ".join(reasons) if count < cfg.num_workers else None,
                "hosts": list(capacity.hosts),
                "started_at": utc_now(),
            }
            write_json_atomic(output.segments, {
                "num_workers": cfg.num_workers, "grad_accum_steps": cfg.grad_accum_steps,
                "min_workers": cfg.lowest_worker_count, "launches": [*segments["launches"], launch]})
        return spec
