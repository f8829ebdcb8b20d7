"""What a training run reports: per-rank JSON lines, the chief's progress line, TensorBoard, GPU samples, MFU."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from trainer.host_info import worker_gpu

log = logging.getLogger("trainer.metrics")

# Live lines: `LIVE_PREFIX` + {"scope": ..., "values": {...}} on stdout, which the operator turns into Airflow
# metrics (tasks/telemetry.py) and keeps out of the task log. Per-step lines only when the operator asks for them
# (Airflow's metrics are on) by setting LIVE_INTERVAL_ENV to the seconds between two lines of a rank.
LIVE_PREFIX = "@gpt_finetune.metrics "
LIVE_INTERVAL_ENV = "GPT_FINETUNE_LIVE_METRICS_S"
LIVE_FIELDS = ("step", "loss", "learning_rate", "tokens_per_s", "step_time_s", "input_wait_s", "grad_norm",
               "gpu_util", "gpu_mem_reserved_mb", "gpu_mem_peak_mb")

# Dense bf16/fp16 tensor-core peak FLOP/s per GPU (vendor datasheets, SXM parts, no sparsity). MFU is reported
# only for GPUs listed here; the name is matched as a substring of the NVML device name.
PEAK_FLOPS_16BIT = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "A100": 312e12,
    "L40S": 362.05e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
}


class MetricsLog:
    """Appends one JSON object per optimizer step to this rank's file (`metrics/rank-<r>.jsonl`)."""

    def __init__(self, path: Path, resume_from_step: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_lines_after(resume_from_step)
        self._handle = path.open("a", encoding="utf-8")

    def _drop_lines_after(self, step: int) -> None:
        """A retried run repeats the steps after its checkpoint; keep each step once, from the run that counts."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, record: dict[str, Any]) -> None:
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def print_live_line(scope: str, values: dict[str, Any]) -> None:
    print(LIVE_PREFIX + json.dumps({"scope": scope, "values": values}), flush=True)


class LiveMetrics:
    """This rank's step metrics as live lines: the first step, then at most one line per interval, and the last."""

    def __init__(self, total_steps: int, environ: dict[str, str] | None = None) -> None:
        setting = (os.environ if environ is None else environ).get(LIVE_INTERVAL_ENV, "").strip()
        self.interval_s = float(setting) if setting else None
        self.total_steps = total_steps
        self._last: float | None = None

    def maybe_print(self, record: dict[str, Any]) -> None:
        if self.interval_s is None:
            return
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval_s and record["step"] != self.total_steps:
            return
        self._last = now
        values = {key: record[key] for key in LIVE_FIELDS if key in record}
        values["compute_s"] = record["step_time_s"] - record["input_wait_s"]
        print_live_line("worker", values)


class LossDivergedError(FloatingPointError):
    """The training loss became NaN/infinite or rose far above its running minimum: the run fails fast."""


class LossWatch:
    """Fails the step whose loss is not finite, or lies more than `max_rise` nats above the lowest loss so far
    (0 = that check off). Every rank sees the same all-reduced loss, so every rank stops at the same step."""

    def __init__(self, rank: int, max_rise: float) -> None:
        self.rank, self.max_rise = rank, max_rise
        self.lowest: tuple[int, float] | None = None  # (step, loss)

    def check(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            raise LossDivergedError(
                f"rank {self.rank}: the training loss is {loss} at step {step}"
                + (f" (lowest so far {self.lowest[1]:.4f} at step {self.lowest[0]})" if self.lowest else "")
                + ": lower 'learning_rate' or use 'bf16'/'no' for 'mixed_precision'.")
        if self.lowest is None or loss < self.lowest[1]:
            self.lowest = (step, loss)
        lowest_step, lowest = self.lowest
        if self.max_rise and loss > lowest + self.max_rise:
            raise LossDivergedError(
                f"rank {self.rank}: the training loss diverged at step {step}: {loss:.4f} is {loss - lowest:.2f} nats "
                f"above its lowest so far ({lowest:.4f} at step {lowest_step}; the limit 'max_loss_rise' is "
                f"{self.max_rise:g}): lower 'learning_rate' or raise 'warmup_steps' (or 'max_loss_rise', 0 = off).")


class ProgressPrinter:
    """The chief's stdout line every `interval_s`: step/total, loss, tokens/s, ETA."""

    def __init__(self, total_steps: int, interval_s: float = 5.0) -> None:
        self.total_steps = total_steps
        self.interval_s = interval_s
        self._last = 0.0

    def maybe_print(self, step: int, loss: float, lr: float, tokens_per_s: float, seconds_per_step: float) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s and step != self.total_steps:
            return
        self._last = now
        eta = timedelta(seconds=round(seconds_per_step * (self.total_steps - step)))
        print(
            f"step {step}/{self.total_steps} loss {loss:.4f} lr {lr:.2e} "
            f"tokens/s {tokens_per_s:,.0f} ETA {eta}",
            flush=True,
        )


class TensorBoardLog:
    """Scalars per step into a TensorBoard event file (chief only).

    Each step's scalars are one Event record in exactly the form `tf.summary.scalar` writes (a float32 tensor with
    the scalars plugin's metadata), built as protobufs and appended with TF's record writer. No TF op runs: four
    eager `tf.summary.write` calls per step cost the tiny model about 1.5% of its step time.
    """

    def __init__(self, directory: Path) -> None:
        import tensorflow as tf
        from tensorflow.core.framework import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorflow.core.util import event_pb2

        self._event, self._summary, self._tensor = event_pb2.Event, summary_pb2.Summary, tensor_pb2.TensorProto
        self._float, self._scalar_shape = types_pb2.DT_FLOAT, tensor_shape_pb2.TensorShapeProto()
        self._metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
        directory.mkdir(parents=True, exist_ok=True)
        # TF's own naming; a retried attempt adds a file next to the earlier ones, and TensorBoard reads them all.
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.v2"
        self._writer = tf.io.TFRecordWriter(str(directory / name))
        self._writer.write(self._event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=name, metadata=self._metadata, tensor=self._tensor(
            dtype=self._float, tensor_shape=self._scalar_shape, tensor_content=struct.pack("<f", value)))
            for name, value in scalars.items()]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._writer.write(event.SerializeToString())

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def tensorflow_peak_mb(device: str = "GPU:0") -> float | None:
    """The most memory TensorFlow's allocator has held for tensors on `device` since the process started (MiB): what
    training needs, unlike the device's memory in use. None where TensorFlow has no such device (a CPU host: TF 2.21
    raises ValueError "No matching devices found") or keeps no statistics for it. It starts TensorFlow's runtime: ask
    only once the strategy exists (trainer/strategy.py)."""
    import tensorflow as tf

    try:
        return round(tf.config.experimental.get_memory_info(device)["peak"] / 2**20, 1)
    except ValueError:
        return None


class GpuSampler:
    """This worker's GPU, sampled every step: NVML utilization (`gpu_util`, %) and the memory in use on the device
    (`gpu_mem_reserved_mb`: TensorFlow reserves nearly all of it at start-up, so this is its reservation, not what
    training needs), and the peak TensorFlow's allocator has used (`gpu_mem_peak_mb`, from `read_peak_mb`).

    `sample()` is empty without a GPU or NVML. After start-up no NVML error leaves it: a figure NVML refuses
    (utilization is NotSupported on MIG-enabled GPUs, NO_PERMISSION) is no longer asked for, a lost GPU ends all NVML
    samples, each said once in one log line naming the host, the GPU and NVML's error; training goes on.
    """

    def __init__(self, enabled: bool, read_peak_mb: Callable[[], float | None] | None = None) -> None:
        self._handle = None
        self.name: str | None = None
        self.host = socket.gethostname()
        self.gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        self._figures: dict[str, Callable[[], float]] = {}
        self._read_peak_mb = read_peak_mb if enabled else None
        self.last: dict[str, float] = {}  # the latest value of each figure, for the summary
        if not enabled:
            return
        try:
            self._nvml, self._handle = worker_gpu()
            self.name = self._nvml.nvmlDeviceGetName(self._handle)
        except Exception as error:  # noqa: BLE001 - no driver / no library: report without GPU samples
            log.info("NVML unavailable on %s for %s (%s): metrics lines carry no NVML samples", self.host,
                     self._gpu_label(), error)
            self._handle = None
            return
        self._figures = {"gpu_util": self._utilization, "gpu_mem_reserved_mb": self._memory_used_mb}

    def _gpu_label(self) -> str:
        gpu = f"GPU {self.gpu}" if self.gpu.isdigit() else self.gpu  # an index, or a UUID that says GPU-...
        return f"{gpu} ({self.name})" if self.name else gpu

    def _utilization(self) -> float:
        return float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)

    def _memory_used_mb(self) -> float:
        return round(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used / 2**20, 1)

    def sample(self) -> dict[str, float]:
        values = {}
        for figure in list(self._figures):
            if figure not in self._figures:  # a lost GPU ended them all
                continue
            try:
                values[figure] = self._figures[figure]()
            except self._nvml.NVMLError as error:
                self._stop(figure, error)
        if self._read_peak_mb is not None:
            peak = self._read_peak_mb()
            if peak is None:
                log.warning("host %s, %s: TensorFlow keeps no memory statistics for this GPU: no gpu_mem_peak_mb "
                            "samples; training goes on", self.host, self._gpu_label())
                self._read_peak_mb = None
            else:
                values["gpu_mem_peak_mb"] = peak
        self.last.update(values)
        return values

    def _stop(self, figure: str, error: Exception) -> None:
        """Ask NVML no more for `figure` (for any figure, when the GPU is lost), and say so once."""
        if getattr(error, "value", None) == self._nvml.NVML_ERROR_GPU_IS_LOST:
            self._figures.clear()
            log.error("host %s, %s: the GPU is lost (NVML: %s; it fell off the bus or stopped answering): no more "
                      "NVML samples from it; the host's kernel log (dmesg, Xid errors) says why", self.host,
                      self._gpu_label(), error)
            return
        del self._figures[figure]
        log.warning("host %s, %s: NVML refused %s (%s%s): no more %s samples; training goes on", self.host,
                    self._gpu_label(), figure, error,
                    ", as on MIG-enabled GPUs" if getattr(error, "value", None) == self._nvml.NVML_ERROR_NOT_SUPPORTED
                    else "", figure)

    def peak_flops(self) -> float | None:
        if not self.name:
            return None
        return next((flops for key, flops in PEAK_FLOPS_16BIT.items() if key in self.name), None)
