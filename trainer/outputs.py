"""What training leaves behind: the metrics and TensorBoard files (published to object storage when the output is
remote), the exported model with its tokenizer, and the chief's summary.json (docs/CONTRACTS.md)."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core import storage
from core.clock import utc_now
from core.layout import EXPORTS_RECORD
from trainer.data import tokenizer_url
from trainer.host_info import hardware_info, versions
from trainer.job import TrainJob

log = logging.getLogger("trainer.outputs")


class OutputFiles:
    """This worker's metrics file and the TensorBoard files, written where the output is when it is on this machine,
    else in the work directory and published to object storage."""

    def __init__(self, job: TrainJob, work_dir: Path) -> None:
        self.output = job.output
        local = work_dir / "output"
        # An earlier attempt's lines are kept: the metrics file is appended to, and published whole.
        self.metrics_file = storage.local_copy(job.output.metrics_file(job.rank), local / "metrics")
        self.tensorboard = storage.local_target(job.output.tensorboard, local)

    def publish(self, include_tensorboard: bool) -> None:
        if self.metrics_file.exists():
            storage.publish_files(self.metrics_file.parent, self.output.metrics, [self.metrics_file.name])
        if include_tensorboard and self.tensorboard.exists():
            storage.publish_files(self.tensorboard, self.output.tensorboard)


def export_model(job: TrainJob, model, work_dir: Path) -> None:
    """Chief: the model with its tokenizer to `TrainOutput.model` as a Hugging Face checkpoint (trainer.decoders'
    save_pretrained: complete or absent, config.json last), then the formats of `export_formats` read back and
    compared with the trained model, the SavedModel and exports.json (last) to `TrainOutput.exports`
    (trainer/export.py). Other workers write nothing: saving runs no collective."""
    if not job.is_chief:
        return
    from trainer.decoders.pretrained import save_pretrained
    from trainer.model import stage_model_dir

    if model.adapters is not None:  # the adapter in PEFT's layout; the model directory holds the merged weights
        from trainer.adapter_export import write_adapter
        from trainer.lora import merged_decoder

        write_adapter(job.cfg, model.adapters, job.output.adapter)
        model = merged_decoder(model)
    save_pretrained(model, job.output.model, tokenizer_dir=tokenizer_url(job.manifest_url, job.manifest))
    if not job.cfg.promotion.export_formats:
        log.info("model and tokenizer saved to %s (setting 'export_formats' = []: nothing checked)", job.output.model)
        return
    # Read back from where it was published, as its users will read it.
    model_dir = Path(stage_model_dir(job.output.model, work_dir))
    with storage.staging_directory(job.output.exports) as exports:
        record = export_serving_formats(job, model, model_dir, exports)
        storage.publish_directory(exports, job.output.exports, last=(
            EXPORTS_RECORD, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()))
    log.info("model and tokenizer saved to %s; exports %s to %s", job.output.model,
             ", ".join(f"{name} {'passed' if result['passed'] else 'FAILED'}"
                       for name, result in record["formats"].items()), job.output.exports)


def export_serving_formats(job: TrainJob, model, model_dir: Path, target: Path) -> dict[str, Any]:
    """exports.json's content: every format compared with the trained model on the validation split's first
    sequences (`model_dir`: the published model, read back; `target`: where the SavedModel is written); a failure
    is recorded (promotion refuses it), never raised."""
    from trainer import export

    try:
        prompts = export.validation_prompts(job.manifest_url, job.manifest)
        return export.export_formats(model, model_dir, target, job.cfg.promotion.export_formats, prompts)
    except Exception as error:  # recorded: without prompts or the trained model's logits nothing can be proven
        log.exception("no format could be checked")
        return export.failed_record(job.cfg.promotion.export_formats, f"not checked: {type(error).__name__}: {error}")


@dataclass(frozen=True)
class Started:
    """When the worker process started: `clock_s` on the monotonic clock (the summary's wall time), `at` in UTC."""

    clock_s: float
    at: str

    @classmethod
    def now(cls) -> Started:
        return cls(time.perf_counter(), utc_now())


@dataclass
class LoopTimes:
    """Where this attempt's time went; the first step (tracing, compilation) is kept apart from throughput."""

    start_step: int
    step: int
    loss: float = math.nan
    first_step_s: float | None = None
    timed_from: float | None = None  # end of the first step
    timed_until: float | None = None  # end of the last step (checkpoints in between count, the export not)
    input_wait_s: float = 0.0
    preempted: bool = False  # the loop stopped on a preemption notice, checkpoint saved

    @property
    def timed_steps(self) -> int:
        return max(0, self.step - self.start_step - 1)

    @property
    def train_time_s(self) -> float:
        return self.timed_until - self.timed_from if self.timed_steps else 0.0


def build_summary(job: TrainJob, model, times: LoopTimes, outputs: OutputFiles, gpu, started: Started,
                  allreduce: dict[str, Any] | None) -> dict[str, Any]:
    """The chief's summary.json (docs/CONTRACTS.md, "Worker entry points"); `allreduce`: what the gradients'
    all-reduce became (trainer/allreduce.py)."""
    from trainer.memory_forecast import summary_record
    from trainer.model import flops_per_token

    cfg = job.cfg
    train_time = times.train_time_s
    tokens_per_s = times.timed_steps * job.tokens_per_step / train_time if train_time > 0 else None
    peak = gpu.peak_flops()
    mfu = (
        tokens_per_s * flops_per_token(model, cfg.block_size) / (peak * cfg.num_workers)
        if tokens_per_s and peak else None
    )
    # Restarted after the last checkpoint: nothing was trained now, the final loss is the logged one.
    final_loss = times.loss if times.step > times.start_step else last_logged_loss(outputs.metrics_file)
    return {
        "num_workers": cfg.num_workers, "global_batch_size": cfg.global_batch_size, "steps": times.step,
        "tokens_seen": times.step * job.tokens_per_step, "wall_time_s": round(time.perf_counter() - started.clock_s, 3),
        "train_time_s": round(train_time, 3), "tokens_per_s": tokens_per_s, "final_loss": final_loss, "mfu": mfu,
        "resumed_from_step": times.start_step, "first_step_s": times.first_step_s, "steps_timed": times.timed_steps,
        "input_wait_fraction": times.input_wait_s / train_time if train_time > 0 else None,
        "data_order": "per_slot" if job.slot_order else "per_worker",
        # The gradients' size, for the scaling advisor when this summary stands in for its probe.
        "parameters": int(sum(v.shape.num_elements() for v in model.trainable_variables)),
        "variable_parameters": [int(v.shape.num_elements()) for v in model.trainable_variables],
        "gradient_dtype": model.trainable_variables[0].dtype.name, "allreduce": allreduce,
        # This rank's GPU at its last step: the memory in use on the device (TensorFlow's reservation) and the peak
        # TensorFlow used for tensors (what training needs); null without a GPU (the first also without NVML).
        "gpu_mem_reserved_mb": gpu.last.get("gpu_mem_reserved_mb"), "gpu_mem_peak_mb": gpu.last.get("gpu_mem_peak_mb"),
        "memory": summary_record(cfg, model.config, gpu.last.get("gpu_mem_peak_mb")),
        "hardware": hardware_info(gpu.name, "GPU" if cfg.use_gpu else "CPU"), "versions": versions(),
        "config": cfg.to_dict(), "started_at": started.at, "finished_at": utc_now(),
    }


def last_logged_loss(metrics_file: Path) -> float | None:
    lines = [line for line in metrics_file.read_text().splitlines() if line] if metrics_file.exists() else []
    return json.loads(lines[-1])["loss"] if lines else None


def write_summary(job: TrainJob, summary: dict[str, Any]) -> None:
    """Written last, by the chief: readers take a summary as the sign that training finished."""
    storage.write_json_atomic(job.output.summary, summary)
    log.info("summary written to %s: %s tokens/s, final loss %.4f", job.output.summary,
             f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "n/a", summary["final_loss"])
