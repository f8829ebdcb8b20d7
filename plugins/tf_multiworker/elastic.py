"""Exact elastic recovery: the train task continues on fewer workers with more accumulation, same global batch.

The trainer's data order is defined per slot of the global batch (`trainer/train.py`): any split of the same
`num_workers x grad_accum_steps` slots over N' workers x (slots / N') micro-steps reads the same sequences at every
step and follows the same loss curve, and checkpoints hold no per-worker state. So when fewer workers are usable
(a host unreachable or without free GPUs, fewer free local GPUs, or the local cap `TFMW_LOCAL_USABLE_WORKERS`),
`ElasticTrainOperator` launches the largest exact count N' >= `min_workers` that fits, with a config of N' workers
written next to the run's, and the trainer resumes from the last checkpoint at the exact step and data position.

Every launch is recorded in the training output's `segments.json` (the report shows each segment with its steps,
workers and tokens/s) and logged as "continued on 2 of 4 workers from step 20: host h unreachable".
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from tf_multiworker.launcher import GroupSpec, LaunchError
from tf_multiworker.launcher.backend import Backend
from tf_multiworker.operator import TFMultiWorkerOperator
from trainer.config import ConfigError, RunConfig
from trainer.layout import TrainOutput
from trainer.storage import exists, join, read_bytes, read_json, write_json_atomic

# Tests (and operators who want to keep cores free) cap the workers the local backend may start.
LOCAL_USABLE_WORKERS_ENV = "TFMW_LOCAL_USABLE_WORKERS"
_CHECKPOINT_PATH = re.compile(rb'model_checkpoint_path:\s*"[^"]*ckpt-(\d+)"')


def latest_checkpoint_step(checkpoints_url: str) -> int:
    """The step of the newest checkpoint in the trainer's index file; 0 when there is none."""
    index = join(checkpoints_url, "checkpoint")
    if not exists(index):
        return 0
    found = _CHECKPOINT_PATH.search(read_bytes(index))
    return int(found.group(1)) if found else 0


def local_capacity(cfg: RunConfig, backend: Backend, environ=os.environ) -> tuple[int, list[str]]:
    """Workers the local backend may start now, and why fewer than asked."""
    capacity, reasons = cfg.num_workers, []
    raw = environ.get(LOCAL_USABLE_WORKERS_ENV, "").strip()
    if raw:
        if not raw.isdigit():
            raise LaunchError(f"{LOCAL_USABLE_WORKERS_ENV}={raw!r} is not a whole number of workers: fix or unset it.")
        if int(raw) < capacity:
            capacity = int(raw)
            reasons.append(f"this machine allows {capacity} worker(s) ({LOCAL_USABLE_WORKERS_ENV}={raw})")
    if cfg.use_gpu:
        free = backend.gpu_probe()
        if len(free) < capacity:
            capacity = len(free)
            reasons.append(f"this machine has {len(free)} free GPU(s) {free}")
    return capacity, reasons


def ssh_capacity(cfg: RunConfig, backend: Backend, log) -> tuple[int, list[str]]:
    """Probe every host (all at once); an unreachable host, or one without free GPUs, is left out of this launch
    (the backend keeps only the usable hosts, in their order). Returns the workers they take and why fewer than
    asked."""
    usable, capacity, reasons = [], 0, []
    payload = {"ports": 0, "workdir": backend.remote_workdir, "use_gpu": cfg.use_gpu}
    for host, probe in zip(backend.hosts, backend.ask_all(backend.hosts, "probe", payload), strict=True):
        if isinstance(probe, LaunchError):
            log.warning("leaving host %s out of this launch: %s", host, probe)
            reasons.append(f"host {host.address} unreachable")
            continue
        slots = backend.workers_per_host or (len(probe["free_gpus"]) if cfg.use_gpu else 1)
        if cfg.use_gpu:
            slots = min(slots, len(probe["free_gpus"]))
        if not slots:
            reasons.append(f"host {host.address} has no free GPU")
            continue
        usable.append(host)
        capacity += slots
    backend.hosts = usable  # this task's own backend: placement uses only the hosts that answered
    return capacity, reasons


def usable_workers(cfg: RunConfig, backend: Backend, log) -> tuple[int, list[str]]:
    if backend.name == "local":
        return local_capacity(cfg, backend)
    if backend.name == "ssh":
        return ssh_capacity(cfg, backend, log)
    return cfg.num_workers, []  # the backend places or fails by itself


def choose_count(cfg: RunConfig, capacity: int, reasons: list[str]) -> int:
    """The largest exact worker count from `num_workers` down to `min_workers` that `capacity` allows."""
    fitting = [count for count in cfg.elastic_worker_counts if count <= capacity]
    if fitting:
        return fitting[0]
    why = "; ".join(reasons) or "placement found fewer workers"
    raise LaunchError(
        f"only {capacity} of {cfg.num_workers} workers are usable ({why}), below 'min_workers' = "
        f"{cfg.lowest_worker_count}: exact worker counts for this run are {cfg.elastic_worker_counts}. Bring the "
        "hosts/GPUs back, or lower 'min_workers' to a count that splits the global batch exactly.")


def _replace_arg(args: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    index = args.index(flag)
    return (*args[:index + 1], value, *args[index + 2:])


def _arg(args: tuple[str, ...], flag: str) -> str:
    if flag not in args[:-1]:
        raise LaunchError(f"the elastic train task needs the trainer's {flag} argument, got {list(args)}")
    return args[args.index(flag) + 1]


class ElasticTrainOperator(TFMultiWorkerOperator):
    """`TFMultiWorkerOperator` for `trainer.train` that launches on fewer workers when fewer are usable.

    Reads `min_workers` and the rest of the run's settings from `backend_settings` (the run's
    `RunConfig.to_dict()`) and the trainer's `--config` and `--output` from `args`. Off (`min_workers` unset or
    equal to `num_workers`) it launches as its parent does, and still records the launch in `segments.json`.
    """

    def plan_group(self, context: Any, spec: GroupSpec, backend: Backend) -> GroupSpec:
        cfg = RunConfig.from_params(self.backend_settings or {})
        config_url, output = _arg(spec.args, "--config"), TrainOutput(_arg(spec.args, "--output"))
        count, reasons = cfg.num_workers, []
        if cfg.lowest_worker_count < cfg.num_workers:
            capacity, reasons = usable_workers(cfg, backend, self.log)
            count = choose_count(cfg, capacity, reasons)
        with self.hook.applied():
            step = latest_checkpoint_step(output.checkpoints)
            segments = read_json(output.segments) if exists(output.segments) else {"launches": []}
            if count < cfg.num_workers:
                hosts = {"ssh_conn_ids": [h.conn_id for h in backend.hosts]} if backend.name == "ssh" else {}
                try:
                    smaller = cfg.for_workers(count, **hosts)
                except ConfigError as error:
                    raise LaunchError(f"cannot continue on {count} workers: {error}") from None
                config_url = join(output.url, f"config-{count}-workers.json")
                write_json_atomic(config_url, smaller.to_dict())
                spec = replace(spec, num_workers=count, args=_replace_arg(spec.args, "--config", config_url))
                self.log.warning(
                    "continued on %d of %d workers from step %d: %s; %d accumulation steps per worker keep the "
                    "global batch at %d sequences and every slot's data order (config %s)", count,
                    cfg.num_workers, step, "; ".join(reasons), smaller.grad_accum_steps, cfg.global_batch_size,
                    config_url)
            launch = {
                "try_number": context["ti"].try_number, "from_step": step, "num_workers": count,
                "grad_accum_steps": cfg.num_workers * cfg.grad_accum_steps // count, "config_url": config_url,
                "reason": "; ".join(reasons) if count < cfg.num_workers else None,
                "hosts": [h.address for h in backend.hosts] if backend.name == "ssh" else [],
                "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            write_json_atomic(output.segments, {
                "num_workers": cfg.num_workers, "grad_accum_steps": cfg.grad_accum_steps,
                "min_workers": cfg.lowest_worker_count, "launches": [*segments["launches"], launch]})
        return spec
