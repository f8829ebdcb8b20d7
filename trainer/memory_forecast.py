"""What one worker's training needs in memory, forecast from the model's shape and the run's settings without
TensorFlow, so that a run that cannot fit is refused before launch (preflight) and the advisor and the report show
where the memory goes.

Per worker, in the run's dtypes:
- weights: the trained ones float32; a LoRA run's frozen base in `base_weights_dtype` (its norms and biases
  float32) plus the adapters; with mixed precision the matrices' compute-dtype copies the matmuls keep for the
  backward pass (none for a bfloat16 base under `bf16`: the matmuls read it as it is);
- gradients: float32 per trainable weight, twice (the backward pass's and the clipped ones the update reads), and
  once more with accumulation (the running sum beside the micro-step's);
- optimizer: AdamW's two float32 moments per trainable weight;
- activations: what each block keeps for the backward pass for `batch_size_per_worker` x `block_size` tokens
  (below), or with `recompute` only each block's input, plus one block's whole set while it is recomputed where
  that exceeds the logits' (they are freed before the first block's backward pass);
- logits: the head's output, its softmax and their gradient (batch x block x vocab, float32).

A block's saved tensors, per token (h: width, i: MLP width, a: heads, T: block size; elements): LayerNorms 2h each
(input and normalised), q k v 3h and their per-head copies 3h, the attention's output h, the residual h, the MLP's
input i and GELU's intermediates 4i and output i, plus the softmax probabilities a*T (float32). Mixed precision
halves the matmul outputs (q k v, attention output, MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.model_shapes import DecoderShape

MIB = 1 << 20
CUDA_CONTEXT_MB = 780  # what a CUDA context takes on the device, measured on an H200 (docs/adapters.md)
# Elements kept per token and block: float32 parts (norms, residual) and matmul outputs (compute dtype).
_FLOAT32_PER_HIDDEN = 2 + 2 + 1  # two LayerNorms' input and output, the residual
_MATMUL_PER_HIDDEN = 3 + 3 + 1  # q k v, their per-head transposes, the attention's output
_MATMUL_PER_INNER = 1 + 4 + 1  # the MLP's input, the tanh GELU's intermediates, its output
LOGIT_COPIES = 3  # logits, their softmax, their gradient


@dataclass(frozen=True)
class MemoryForecast:
    """Bytes per worker by kind; `total` is the forecast peak."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    def as_mib(self) -> dict[str, float]:
        parts = {"weights": self.weights, "gradients": self.gradients, "optimizer": self.optimizer,
                 "activations": self.activations, "logits": self.logits, "total": self.total}
        return {name: round(value / MIB, 1) for name, value in parts.items()}


def block_activation_bytes(shape: DecoderShape, tokens: int, block_size: int, compute_bytes: int) -> int:
    """What one block keeps for the backward pass for `tokens` tokens (sequences of `block_size`)."""
    float32 = 4 * tokens * (_FLOAT32_PER_HIDDEN * shape.hidden + shape.heads * block_size)
    matmuls = compute_bytes * tokens * (_MATMUL_PER_HIDDEN * shape.hidden + _MATMUL_PER_INNER * shape.intermediate)
    return float32 + matmuls


@dataclass(frozen=True)
class Workload:
    """What one worker does with the model: `batch` sequences of `block_size` per micro-step, in the run's dtypes.
    `trainable`: the trained elements (LoRA's adapters; None: every weight, no frozen base)."""

    batch: int
    block_size: int
    grad_accum_steps: int = 1
    mixed_precision: str = "no"
    trainable: int | None = None
    base_weights_dtype: str = "float32"
    recompute: bool = False


def forecast(shape: DecoderShape, work: Workload) -> MemoryForecast:
    """The forecast for one worker of a model of `shape` doing `work`."""
    batch, block_size, mixed_precision = work.batch, work.block_size, work.mixed_precision
    trainable, base_weights_dtype = work.trainable, work.base_weights_dtype
    matrices, vectors = shape.matrix_parameters(), shape.vector_parameters()
    compute_bytes = 4 if mixed_precision == "no" else 2
    # The matmuls' cast weights; a frozen bfloat16 base computed in bfloat16 is read as it is (a cast to its dtype).
    cast_free = compute_bytes == 4 or (trainable is not None and base_weights_dtype == "bfloat16"
                                       and mixed_precision == "bf16")
    if trainable is None:
        trainable, stored = matrices + vectors, 4 * (matrices + vectors)
    else:
        stored = (2 if base_weights_dtype == "bfloat16" else 4) * matrices + 4 * vectors + 4 * trainable
    copies = 0 if cast_free else compute_bytes * matrices
    tokens = batch * block_size
    block = block_activation_bytes(shape, tokens, block_size, compute_bytes)
    logits = LOGIT_COPIES * 4 * tokens * shape.vocab
    if work.recompute:
        # The head's tensors are gone before the first block is recomputed: the peak holds the larger of the two.
        activations = shape.layers * 4 * tokens * shape.hidden + max(0, block - logits)
    else:
        activations = shape.layers * block
    return MemoryForecast(
        weights=stored + copies, gradients=4 * trainable * (3 if work.grad_accum_steps > 1 else 2),
        optimizer=8 * trainable, activations=activations, logits=logits)


def run_forecast(cfg: Any, shape: DecoderShape) -> MemoryForecast:
    """The forecast of `cfg`'s run on a model of `shape` (its LoRA adapters planned from `cfg`)."""
    from trainer.lora_plan import plan_lora

    plan = plan_lora(cfg, shape)
    return forecast(shape, Workload(
        batch=cfg.batch_size_per_worker, block_size=cfg.block_size, grad_accum_steps=cfg.grad_accum_steps,
        mixed_precision=cfg.mixed_precision, trainable=plan.parameters if plan else None,
        base_weights_dtype=cfg.base_weights_dtype, recompute=cfg.recompute))


def levers(cfg: Any) -> list[str]:
    """The settings that lower the forecast, as sentences, those the run does not use yet first."""
    batch = f"lower 'batch_size_per_worker' (now {cfg.batch_size_per_worker}) with more 'grad_accum_steps' or "
    found = [batch + "'num_workers'"]
    if not cfg.recompute:
        found.append("set 'recompute' to true (activations of one block at a time)")
    if cfg.adapter != "lora":
        found.append("set 'adapter' to 'lora' (gradients and AdamW states for the adapters only)")
    elif cfg.base_weights_dtype != "bfloat16":
        found.append("set 'base_weights_dtype' to 'bfloat16' (the frozen weights in half the memory)")
    if cfg.mixed_precision == "no" and cfg.use_gpu:
        found.append("set 'mixed_precision' to 'bf16' (activations in half the memory)")
    return found


def fit_error(cfg: Any, predicted: MemoryForecast, free_mb: int, where: str) -> str | None:
    """The refusal of a run whose forecast exceeds `free_mb` of a GPU, naming the parts and the levers; else None."""
    if predicted.total <= free_mb * MIB:
        return None
    parts = ", ".join(f"{name} {value:,.0f}" for name, value in predicted.as_mib().items() if name != "total")
    return (f"{where}: the training forecast is {predicted.total / MIB:,.0f} MiB per worker ({parts} MiB) but the "
            f"GPU has {free_mb:,} MiB free beside a CUDA context: it would run out of memory at its first step. To "
            "fit, " + "; or ".join(levers(cfg)) + ".")


def summary_record(cfg: Any, decoder_config: Any, gpu_peak_mb: float | None) -> dict[str, Any]:
    """summary.json's `memory`: the forecast beside what this worker measured: TensorFlow's peak on the GPU, or
    without one the process's peak resident memory (which also holds TensorFlow itself, the input pipeline and the
    export)."""
    import resource

    from trainer.model_shapes import shape_of

    record: dict[str, Any] = {"forecast_mb": run_forecast(cfg, shape_of(decoder_config)).as_mib()}
    if gpu_peak_mb is not None:
        record["gpu_mem_peak_mb"] = gpu_peak_mb
    else:
        record["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # KiB on Linux
    return record
