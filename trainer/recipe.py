"""The training recipe around the optimizer: the learning-rate schedule, global-norm clipping and seeds.

The schedule computes what tf-keras' `CosineDecay` with warmup computes (the same float32 operations in the same
order), so runs made before and after the move from tf-keras follow the same rates:

- warmup: linear from `peak / (warmup_steps + 1)` at step 0 (not 0, so the first step already learns, as nanoGPT
  does) to `peak` at step `warmup_steps`;
- then cosine from `peak` down to `FINAL_LR_FRACTION` of it at `max_steps`, and flat after.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from trainer.optim import FINAL_LR_FRACTION, GRAD_CLIP_NORM


@dataclass(frozen=True)
class WarmupCosine:
    """The learning rate at an optimizer step (0 for the first update); call with an int or integer tensor."""

    peak: float
    warmup_steps: int
    decay_steps: int
    final_fraction: float = FINAL_LR_FRACTION

    def __post_init__(self) -> None:
        if not self.peak > 0 or self.warmup_steps < 0 or self.decay_steps < 1 or not 0 <= self.final_fraction <= 1:
            raise ValueError(f"{self}: needs peak > 0, warmup_steps >= 0, decay_steps >= 1 and final_fraction in "
                             "[0, 1]; set 'learning_rate', 'warmup_steps' and 'max_steps' accordingly.")

    def __call__(self, step: Any) -> tf.Tensor:
        start = tf.convert_to_tensor(self.peak / (self.warmup_steps + 1), tf.float32)
        peak = tf.cast(self.peak, tf.float32)
        warmup_steps = tf.cast(self.warmup_steps, tf.float32)
        decay_steps = tf.cast(self.decay_steps, tf.float32)
        step = tf.minimum(tf.cast(step, tf.float32), decay_steps + warmup_steps)
        return tf.cond(step < warmup_steps,
                       lambda: (peak - start) * (step / warmup_steps) + start,
                       lambda: self._cosine(step - warmup_steps, decay_steps, peak))

    def _cosine(self, step: tf.Tensor, decay_steps: tf.Tensor, peak: tf.Tensor) -> tf.Tensor:
        completed_fraction = step / decay_steps
        cosine = 0.5 * (1.0 + tf.cos(tf.constant(math.pi, tf.float32) * completed_fraction))
        return tf.multiply(peak, (1 - self.final_fraction) * cosine + self.final_fraction)


def learning_rate_schedule(cfg: Any) -> WarmupCosine:
    """The run's schedule from its `learning_rate`, `warmup_steps` and `max_steps` (resolved: the train config)."""
    return WarmupCosine(peak=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                        decay_steps=max(1, cfg.max_steps - cfg.warmup_steps))


def clip_gradients(gradients: list[tf.Tensor], clip_norm: float = GRAD_CLIP_NORM) -> tuple[list[tf.Tensor], tf.Tensor]:
    """The gradients scaled down together to a global norm of at most `clip_norm`, and their norm before. Clip after
    the all-reduce, so every split of the global batch over workers and micro-steps clips the same gradient; a
    non-finite norm makes every gradient NaN, which a loss scale then skips (trainer/precision.py)."""
    clipped, norm = tf.clip_by_global_norm(gradients, clip_norm)
    return clipped, norm


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's and TensorFlow's global generators, as tf-keras' `utils.set_random_seed` does."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {seed!r}: set 'seed' in the run config.")
    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)
