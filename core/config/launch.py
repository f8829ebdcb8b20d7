"""The launch settings of a run: backend, worker counts, SSH hosts, Kubernetes pods, collectives and queue.

Formats are checked whatever the backend (a Kubernetes name is checked here, so a bad one fails before anything is
created); the rules between settings apply to the backend chosen. Workers that run elsewhere (SSH hosts, pods)
share no filesystem with the Airflow worker, so they need an s3:// storage root.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

from core.config import schema
from core.config.access import is_hub_id
from core.config.core import MAX_GRAD_ACCUM, ConfigError, check_choice
from core.kubernetes_names import (
    TOLERATION_EFFECTS,
    TOLERATION_KEYS,
    TOLERATION_OPERATORS,
    is_dns_label,
    is_dns_subdomain,
    is_label,
)

# What TensorFlow's NCCL all-reduce carries (tensorflow/core/nccl/nccl_manager.cc, kValidDataTypes): no bfloat16.
NCCL_DTYPES = ("float16", "float32", "float64", "int32", "int64")
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
QUEUE_NAME = re.compile(schema.QUEUE_NAME)
_CONN_ID = re.compile(schema.CONN_ID)
# Kubernetes formats (apimachinery validation; the names and labels are core.kubernetes_names').
DEFAULT_TRAINER_IMAGE = schema.DEFAULT_TRAINER_IMAGE
_CPU_QUANTITY = re.compile(schema.CPU_QUANTITY)
_MEMORY_QUANTITY = re.compile(schema.MEMORY_QUANTITY)
_IMAGE = re.compile(schema.IMAGE)


def exact_worker_counts(num_workers: int, grad_accum_steps: int, lowest: int) -> list[int]:
    """Counts from `num_workers` down to `lowest` that divide the global batch's slots (num_workers x
    grad_accum_steps) within the accumulation limit, highest first: each keeps every slot's data exact."""
    slots = num_workers * grad_accum_steps
    return [n for n in range(num_workers, max(lowest, 1) - 1, -1) if slots % n == 0 and slots // n <= MAX_GRAD_ACCUM]


def resolve_communication(communication: str, use_gpu: bool) -> str:
    """The collective implementation `communication` runs as, 'nccl' or 'ring'. `auto` is NCCL with `use_gpu`, else
    ring: TF2's own AUTO never picks NCCL (its collectives take NCCL from the hint alone), so a GPU run left on AUTO
    would all-reduce over gRPC rings through host memory."""
    if communication != "auto":
        return communication
    return "nccl" if use_gpu else "ring"


def check_launch_settings(cfg: Any) -> None:
    """The rules of a RunConfig's launch settings (its field types and bounds are checked first)."""
    for name in ("backend", "communication", "allreduce_dtype"):
        check_choice(name, schema.value_of(cfg, name), schema.choices(type(cfg), name))
    if cfg.launch.gpu_queue and not QUEUE_NAME.fullmatch(cfg.launch.gpu_queue):
        raise ConfigError(
            f"Setting 'gpu_queue' = {cfg.launch.gpu_queue!r} is not a queue name: letters, digits, '_', '.' and '-', "
            "starting with a letter or digit, at most 200 characters (empty: the default queue). Name the queue that "
            "the GPU hosts' Celery workers serve (`airflow celery worker -q <queue>`).")
    _check_ssh(cfg)
    _check_scaling(cfg)
    if cfg.communication == "nccl" and not cfg.use_gpu:
        raise ConfigError("Setting 'communication' = 'nccl' needs 'use_gpu' = true: use 'ring' or 'auto' on CPU.")
    _check_wire_dtype(cfg)
    _check_kubernetes(cfg)


def _check_wire_dtype(cfg: Any) -> None:
    """NCCL cannot carry the wire dtype: TF's NcclManager would fail every rank's first step, and every retry's."""
    if resolve_communication(cfg.communication, cfg.use_gpu) != "nccl" or cfg.allreduce_dtype in NCCL_DTYPES:
        return
    resolved = "" if cfg.communication == "nccl" else " ('communication' = 'auto' is NCCL with 'use_gpu')"
    raise ConfigError(
        f"Setting 'allreduce_dtype' = {cfg.allreduce_dtype!r} cannot go over NCCL{resolved}: TensorFlow's NCCL "
        f"all-reduce carries {', '.join(NCCL_DTYPES)} only, so every worker would fail at the first step. Set "
        "'allreduce_dtype' to 'float32' to keep NCCL (generally the faster one between GPUs), or 'communication' to "
        f"'ring' to keep {cfg.allreduce_dtype} on the wire.")


def _check_kubernetes(cfg: Any) -> None:
    """The kubernetes backend's settings: formats always, the rules between them when that backend is chosen."""
    pods = cfg.launch.kubernetes
    if not is_dns_label(pods.namespace):
        raise ConfigError(
            f"Setting 'namespace' = {pods.namespace!r} is not a Kubernetes namespace name: a DNS label of at most 63 "
            "lowercase letters, digits and '-', starting and ending with a letter or digit."
        )
    if cfg.launch.backend == "kubernetes" and not pods.image.strip():
        raise ConfigError("Setting 'image' must name the trainer image for backend 'kubernetes', e.g. "
                          f"{DEFAULT_TRAINER_IMAGE!r} (docker/trainer.Dockerfile).")
    if cfg.launch.backend == "kubernetes":
        _check_shared_storage(cfg, "backend 'kubernetes' runs workers in pods", "the pods")
    if pods.image and not _IMAGE.fullmatch(pods.image):
        raise ConfigError(f"Setting 'image' = {pods.image!r} is not an image reference (registry/name:tag).")
    _check_pod_resources(cfg)
    _check_node_selector(pods.node_selector)
    for toleration in pods.tolerations:
        _check_toleration(toleration)
    if pods.service_account and not is_dns_subdomain(pods.service_account):
        raise ConfigError(f"Setting 'service_account' = {pods.service_account!r} is not a service account name "
                          "(lowercase letters, digits, '-' and '.').")


def _check_pod_resources(cfg: Any) -> None:
    pods = cfg.launch.kubernetes
    if pods.gpus_per_worker and not cfg.use_gpu:
        raise ConfigError(f"Setting 'gpus_per_worker' = {pods.gpus_per_worker} needs 'use_gpu' = true: set use_gpu, "
                          "or gpus_per_worker to 0 on CPU.")
    if pods.gpus_per_worker and cfg.launch.backend != "kubernetes":
        raise ConfigError(f"Setting 'gpus_per_worker' = {pods.gpus_per_worker} applies to backend 'kubernetes' only "
                          f"(backend is {cfg.launch.backend!r}): set it to 0.")
    if pods.cpu and not _CPU_QUANTITY.fullmatch(pods.cpu):
        raise ConfigError(f"Setting 'cpu' = {pods.cpu!r} is not a CPU quantity: write cores ('4', '0.5') or "
                          "millicores ('500m'), or leave it empty for no request.")
    if pods.memory and not _MEMORY_QUANTITY.fullmatch(pods.memory):
        raise ConfigError(f"Setting 'memory' = {pods.memory!r} is not a memory quantity: write e.g. '16Gi' or "
                          "'512Mi', or leave it empty for no request.")


def _check_node_selector(node_selector: dict[str, str]) -> None:
    for key, value in node_selector.items():
        if not is_label(key, value):
            raise ConfigError(f"Setting 'node_selector' entry {key!r}: {value!r} is not a Kubernetes label: keys "
                              "are [prefix/]name, values at most 63 letters, digits, '-', '_' or '.'.")


def _check_toleration(toleration: dict[str, Any]) -> None:
    unknown = sorted(set(toleration) - TOLERATION_KEYS)
    if unknown:
        raise ConfigError(f"Setting 'tolerations' entry {toleration!r} has unknown keys {unknown}: allowed are "
                          f"{sorted(TOLERATION_KEYS)} (Kubernetes spelling).")
    if toleration.get("operator", "Equal") not in TOLERATION_OPERATORS or \
            toleration.get("effect", "") not in TOLERATION_EFFECTS:
        raise ConfigError(f"Setting 'tolerations' entry {toleration!r}: operator must be one of "
                          f"{list(TOLERATION_OPERATORS)} and effect one of {list(TOLERATION_EFFECTS)}.")
    seconds = toleration.get("tolerationSeconds", 0)
    if not all(isinstance(toleration.get(k, ""), str) and len(toleration.get(k, "")) <= 316 for k in ("key", "value")) \
            or isinstance(seconds, bool) or not isinstance(seconds, int) or seconds < 0:
        raise ConfigError(f"Setting 'tolerations' entry {str(toleration)[:200]!r}: key and value are strings of at "
                          "most 316 characters, tolerationSeconds an integer of 0 or more (the operator's ceiling, "
                          "GPT_FINETUNE_MAX_TOLERATION_S, bounds it).")


def _check_scaling(cfg: Any) -> None:
    """`min_workers`: elastic recovery on fewer workers."""
    if cfg.min_workers is None or cfg.min_workers == cfg.num_workers:
        return
    if not 1 <= cfg.min_workers <= cfg.num_workers:
        raise ConfigError(f"Setting 'min_workers' = {cfg.min_workers} is out of range: allowed is 1 to 'num_workers' "
                          f"= {cfg.num_workers}, or empty for {cfg.num_workers} (no recovery on fewer workers).")
    slots = cfg.num_workers * cfg.grad_accum_steps
    fewer = exact_worker_counts(cfg.num_workers, cfg.grad_accum_steps, cfg.min_workers)[1:]
    if not fewer:
        possible = exact_worker_counts(cfg.num_workers, cfg.grad_accum_steps, 1)[1:]
        raise ConfigError(
            f"Setting 'min_workers' = {cfg.min_workers}: no worker count from {cfg.min_workers} to "
            f"{cfg.num_workers - 1} splits the global batch's {slots} slots (num_workers x grad_accum_steps = "
            f"{cfg.num_workers} x {cfg.grad_accum_steps}) exactly; possible counts below {cfg.num_workers} are "
            f"{possible or 'none'}: set 'min_workers' to one of them, or leave it empty.")
    if cfg.effective_num_shards < slots:
        raise ConfigError(
            f"Setting 'min_workers' = {cfg.min_workers} needs the per-slot data order, one shard per slot of the "
            f"global batch: 'num_shards' = {cfg.effective_num_shards} is below num_workers x grad_accum_steps = "
            f"{slots}: raise 'num_shards' to at least {slots}.")


def _check_shared_storage(cfg: Any, why: str, readers: str) -> None:
    """Workers that run elsewhere reach the run's files only through object storage."""
    if urlparse(cfg.storage_root).scheme != "s3":
        raise ConfigError(
            f"Setting 'storage_root' = {cfg.storage_root!r} is local, but {why}, which share no filesystem with "
            "this one: use an s3:// storage root (shards, checkpoints and results go through it).")
    for name in ("model", "tokenizer"):
        value = getattr(cfg, name)
        if name == "model" and cfg.is_preset_model or name == "tokenizer" and value.startswith("bpe:"):
            continue
        scheme = urlparse(value).scheme
        if scheme == "file" or not scheme and not is_hub_id(value):
            raise ConfigError(f"Setting '{name}' = {value!r} is a local path, which {readers} cannot read: "
                              "put it on the s3:// storage and name its URL, or use a preset or hub id.")


def _check_ssh(cfg: Any) -> None:
    """The SSH backend's settings; connection ids that Airflow does not know are refused by the prepare task."""
    ssh = cfg.launch.ssh
    if ssh.remote_python and not ssh.remote_python.startswith("/"):
        raise ConfigError(f"Setting 'remote_python' = {ssh.remote_python!r} must be an absolute path to the worker "
                          "environment's interpreter on the hosts (e.g. /opt/gpt-finetune/.venv/bin/python), or "
                          "empty for the same path as here.")
    if cfg.launch.backend != "ssh":
        if ssh.ssh_conn_ids:
            raise ConfigError(f"Setting 'ssh_conn_ids' = {list(ssh.ssh_conn_ids)} is only read by backend 'ssh', "
                              f"but 'backend' = {cfg.launch.backend!r}: set 'backend' to 'ssh' or clear "
                              "'ssh_conn_ids'.")
        return
    if not ssh.ssh_conn_ids:
        raise ConfigError("Setting 'backend' = 'ssh' needs 'ssh_conn_ids': the Airflow SSH connections of the hosts, "
                          'one per host, e.g. {"ssh_conn_ids": ["gpu_host_1", "gpu_host_2"]}.')
    for conn_id in ssh.ssh_conn_ids:
        if not _CONN_ID.fullmatch(conn_id):
            raise ConfigError(f"Setting 'ssh_conn_ids' has {conn_id!r}, which is not an Airflow connection id "
                              "(letters, digits, '_', '.', '-').")
    repeated = sorted({c for c in ssh.ssh_conn_ids if ssh.ssh_conn_ids.count(c) > 1})
    if repeated:
        raise ConfigError(f"Setting 'ssh_conn_ids' names {repeated} more than once: list each host once and set "
                          "'workers_per_host' for several workers on a host.")
    if ssh.workers_per_host and ssh.workers_per_host * len(ssh.ssh_conn_ids) != cfg.num_workers:
        raise ConfigError(
            f"'workers_per_host' = {ssh.workers_per_host} x {len(ssh.ssh_conn_ids)} host(s) in 'ssh_conn_ids' = "
            f"{ssh.workers_per_host * len(ssh.ssh_conn_ids)} workers, but 'num_workers' = {cfg.num_workers}: make "
            "them agree, or set 'workers_per_host' to 0 (one per free GPU with use_gpu, else one per host).")
    _check_shared_storage(cfg, "backend 'ssh' runs workers on other hosts", "the SSH hosts")
