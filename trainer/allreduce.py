"""The gradients' trip across the workers: one all-reduce in the wire dtype, in packs that overlap the backward pass.

- **Wire dtype** (`allreduce_dtype`): `bfloat16` halves the bytes on the network. The gradients arrive here already
  divided by the global micro-batch count (the loss is scaled before the backward pass, as DDP's compress hooks
  pre-divide), are cast, all-reduced, and cast back to float32; accumulation, clipping and the update stay float32.
  The one-worker baseline makes the same round trip (its all-reduce is the identity), so loss parity compares like
  with like. No float16: it would need loss scaling on the wire.
- **Packs** (`allreduce_pack_mb`): TF 2.21 concatenates the gradients into packs of at least this many bytes (0: one
  pack) and all-reduces them in reverse variable order. In one graph with the backward pass, a pack starts as soon
  as its gradients exist, so communication hides behind the rest of the backward pass. Collectives run in program
  order (an ordering token), so the loss and norm reductions come after the gradients.
- **Implementation**: the strategy, this all-reduce and the preflight's take their options from one builder
  (`communication_options`), so the preflight's all-reduce carries the wire dtype over the implementation training
  will use; NCCL cannot carry bfloat16, and the config refuses that pair before launch.
- **Once**: the optimizer applies the reduced gradients with `skip_gradients_aggregation=True`; the packs TF logs
  while tracing are recorded (`PackRecorder`), so the summary and a test can see there is exactly one gradient
  all-reduce and how many packs it took.

Imports TensorFlow only inside functions, so the training module imports it before TensorFlow is set up.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Self

log = logging.getLogger("trainer.allreduce")

# TF's trace-time line (tensorflow/python/distribute/cross_device_ops.py, CollectiveAllReduce._all_reduce).
_PACK_LINE = re.compile(r"Collective all_reduce tensors: (\d+) all_reduces, .* num_packs = (\d+)")


class PackRecorder(logging.Handler):
    """Collects TF's "Collective all_reduce tensors: N all_reduces, ..., num_packs = P" lines while a step traces:
    one `(N, P)` per all-reduce call that the traced graph holds."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.calls: list[tuple[int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = _PACK_LINE.search(record.getMessage())
        if found:
            self.calls.append((int(found[1]), int(found[2])))

    def __enter__(self) -> Self:
        self._logger = logging.getLogger("tensorflow")
        self._level, self._propagate = self._logger.level, self._logger.propagate
        self._logger.addHandler(self)
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
            self._logger.propagate = False  # the INFO lines are for this recorder, not the worker's log
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        self._logger.propagate = self._propagate

    def gradient_packs(self, gradients: int) -> int | None:
        """The pack count of the gradients' all-reduce (the call with `gradients` tensors); None when not traced
        (one worker: nothing crosses the network). A second such call would reduce the gradients twice."""
        packs = [p for n, p in self.calls if n == gradients]
        if len(packs) > 1:
            raise RuntimeError(f"the traced step all-reduces its {gradients} gradients {len(packs)} times: the "
                               "optimizer must apply them without aggregating again (skip_gradients_aggregation)")
        return packs[0] if packs else None


def communication_options(cfg: Any, *, pack_mb: float = 0.0, timeout_s: int | None = None) -> Any:
    """TF's options for `cfg`'s collectives: the implementation `communication` resolves to (RunConfig's
    `collective_implementation`), packs of at least `pack_mb` MiB (0: one), and a timeout (None: none)."""
    import tensorflow as tf

    implementations = tf.distribute.experimental.CommunicationImplementation
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=int(pack_mb * 2**20), timeout_seconds=timeout_s,
        implementation={"nccl": implementations.NCCL, "ring": implementations.RING}[cfg.collective_implementation])


class GradientReducer:
    """Sums the per-replica gradients over all workers as the run's settings ask; call in a replica context."""

    def __init__(self, cfg: Any) -> None:
        import tensorflow as tf

        self.dtype, self.implementation = cfg.allreduce_dtype, cfg.collective_implementation
        # With XLA the whole backward pass is one compiled cluster that releases every gradient at once: packs
        # would overlap nothing, so one pack.
        self.pack_mb = 0.0 if cfg.xla else float(cfg.allreduce_pack_mb)
        self._wire = tf.bfloat16 if self.dtype == "bfloat16" else None
        # Call-level options: under XLA on GPUs TF skips the strategy's merge_call and reads only these.
        self._options = communication_options(cfg, pack_mb=self.pack_mb)

    def __call__(self, gradients: list[Any]) -> list[Any]:
        import tensorflow as tf

        if self._wire is not None:
            gradients = [tf.cast(g, self._wire) for g in gradients]
        reduced = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, gradients, options=self._options)
        return [tf.cast(g, tf.float32) for g in reduced] if self._wire is not None else reduced

    def describe(self, variables: list[Any], packs: int | None, xla: bool) -> str:
        """One log line: what crosses the network each step and whether it overlaps the backward pass."""
        count = sum(v.shape.num_elements() for v in variables)
        size = count * (2 if self._wire is not None else variables[0].dtype.size) / 2**20
        head = f"gradients: {len(variables)} tensors, {size:.2f} MiB in {self.dtype} per step"
        if packs is None:
            return f"{head}; one worker: nothing crosses the network"
        head += f" over {self.implementation.upper()}"
        if xla:
            overlap = "XLA compiles the forward and backward passes, so the all-reduce follows them (no overlap)"
        elif packs and packs > 1:
            overlap = f"packs of >= {self.pack_mb:g} MiB overlap the last micro-step's backward pass"
        elif self.pack_mb:
            overlap = f"the gradients fit in one pack of >= {self.pack_mb:g} MiB, sent after the backward pass"
        else:
            overlap = "one pack after the backward pass (allreduce_pack_mb = 0: no overlap)"
        return f"{head} in {packs} pack(s); {overlap}"
