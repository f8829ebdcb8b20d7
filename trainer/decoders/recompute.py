"""Activation recomputation for any decoder's blocks: the backward pass runs a block's forward again instead of
keeping its intermediate activations (TensorFlow's `tf.recompute_grad`), so a block holds only its input between
the passes."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

Block = Callable[[tf.Tensor], tf.Tensor]


def recomputed(block: Block, enabled: bool) -> Block:
    """`block` (the residual stream in, out), recomputed in the backward pass when `enabled`. The gradients reach the
    trainable variables the block reads (tf.recompute_grad watches them), frozen ones get none."""
    return tf.recompute_grad(block) if enabled else block
