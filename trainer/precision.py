"""Mixed precision without Keras: float32 master weights, a low-precision compute dtype, and loss scaling for fp16.

- The variables stay float32 (the optimizer updates them in float32, trainer/adamw.py); the model casts each one
  to `Precision.compute_dtype` where it uses it (`Precision.cast`), so its matmuls run in bfloat16 or float16, and
  the gradients of the variables come back float32 through the casts. The loss is computed in float32.
- float16's range is narrow: small gradients underflow to 0. `LossScale` multiplies the loss by a large factor
  before the backward pass and divides the gradients by it after, as Keras' `LossScaleOptimizer` does, with its
  defaults: start at 2**15, halve (not below 1) and skip the update when a gradient is inf or NaN, double after
  2000 finite steps in a row. bfloat16 has float32's range and needs none.
- Every replica makes the same decision: `LossScale.update` reads the gradients after the all-reduce, which are
  the same on every replica (an inf or NaN on one replica's gradients makes the sum non-finite on all), so each
  replica updates its own copy of the scale and skips the same steps without another collective.
- The scale and its count of finite steps are variables of the `tf.Module`: a checkpoint saves and restores them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

# Keras' LossScaleOptimizer defaults (tf-keras' mixed_precision.LossScaleOptimizer).
INITIAL_LOSS_SCALE = 2.0**15
GROWTH_INTERVAL = 2000
SCALE_FACTOR = 2.0

# The `mixed_precision` setting -> (compute dtype name, the policy name runs log and summaries record).
_SETTINGS = {"no": ("float32", "float32"), "bf16": ("bfloat16", "mixed_bfloat16"),
             "fp16": ("float16", "mixed_float16")}


@dataclass(frozen=True)
class Precision:
    """How a run computes: `setting` is RunConfig's `mixed_precision` ("no", "bf16" or "fp16")."""

    setting: str

    def __post_init__(self) -> None:
        if self.setting not in _SETTINGS:
            raise ValueError(f"mixed_precision {self.setting!r} is not one of {sorted(_SETTINGS)}: set "
                             "'mixed_precision' in the run config.")

    @property
    def compute_dtype(self) -> tf.DType:
        return tf.as_dtype(_SETTINGS[self.setting][0])

    @property
    def policy_name(self) -> str:
        """float32, mixed_bfloat16 or mixed_float16: the names logs and run summaries have always used."""
        return _SETTINGS[self.setting][1]

    @property
    def loss_scaling(self) -> bool:
        """Whether the run needs a `LossScale` (float16 only)."""
        return self.setting == "fp16"

    def cast(self, value: Any) -> tf.Tensor:
        """A float32 variable or tensor in the compute dtype (the variable itself stays float32)."""
        return tf.cast(value, self.compute_dtype)

    def make_loss_scale(self) -> LossScale | None:
        """A new `LossScale` for float16 (make it in the strategy scope), None for the others."""
        return LossScale() if self.loss_scaling else None


def all_finite(gradients: Sequence[tf.Tensor]) -> tf.Tensor:
    """True (a bool tensor) when no gradient holds an inf or a NaN."""
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in gradients])


class LossScale(tf.Module):
    """Dynamic loss scaling: `scale_loss` before the backward pass, `unscale` the gradients after it, then
    `apply_gradients` (after the all-reduce and clipping) updates the scale and applies only finite gradients."""

    def __init__(self, initial_scale: float = INITIAL_LOSS_SCALE, growth_interval: int = GROWTH_INTERVAL,
                 name: str = "loss_scale") -> None:
        super().__init__(name=name)
        if not initial_scale >= 1 or growth_interval < 1:
            raise ValueError(f"a loss scale needs initial_scale >= 1 and growth_interval >= 1, got {initial_scale} "
                             f"and {growth_interval}.")
        self.growth_interval = growth_interval
        self.scale = tf.Variable(initial_scale, dtype=tf.float32, trainable=False, name="scale")
        self.finite_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="finite_steps")

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        return loss * tf.cast(self.scale, loss.dtype)

    def unscale(self, gradients: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The gradients of the scaled loss divided by the scale (exact: the scale is a power of two)."""
        reciprocal = 1.0 / self.scale
        return [g * tf.cast(reciprocal, g.dtype) for g in gradients]

    def update(self, gradients: Sequence[tf.Tensor]) -> tf.Tensor:
        """Halve the scale (not below 1) on a non-finite gradient, double it after `growth_interval` finite steps in
        a row (unless that overflows); returns whether the gradients are finite. Pass the all-reduced gradients."""
        finite = all_finite(gradients)
        counted = self.finite_steps + 1
        grow = tf.logical_and(finite, counted >= self.growth_interval)
        grown = self.scale * SCALE_FACTOR
        kept = tf.where(tf.logical_and(grow, tf.math.is_finite(grown)), grown, self.scale)
        self.scale.assign(tf.where(finite, kept, tf.maximum(self.scale / SCALE_FACTOR, 1.0)))
        self.finite_steps.assign(tf.where(tf.logical_and(finite, tf.logical_not(grow)), counted, 0))
        return finite

    def apply_gradients(self, optimizer: Any, gradients: Sequence[tf.Tensor]) -> tf.Tensor:
        """`update`, then `optimizer.apply_gradients(gradients)` only if they are finite: a skipped step leaves the
        weights, the moments and the optimizer's `iterations` (hence its learning rate) as they were. Returns
        whether the step was applied. Call where the optimizer's `apply_gradients` is called (the replica context)."""
        finite = self.update(gradients)
        gradients = list(gradients)

        def apply() -> tf.Tensor:
            with tf.control_dependencies([optimizer.apply_gradients(gradients)]):
                return tf.constant(True)

        return tf.cond(finite, apply, lambda: tf.constant(False))
