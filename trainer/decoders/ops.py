"""What the decoders compute with, in TensorFlow's core API: LayerNorm, RMSNorm, the tanh GELU, SwiGLU, the
projection of both weight layouts, rotary positions, causal (grouped-query) attention, the token loss and the
model's cost.

Mixed precision as PyTorch's autocast does it: the weights stay float32 and are cast to the compute dtype where a
matmul uses them; the residual stream, LayerNorm and softmax stay float32, so bfloat16 / float16 lose precision in
the matmuls only.
"""

from __future__ import annotations

import math

import tensorflow as tf

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def layer_norm(x: tf.Tensor, weight: tf.Variable, bias: tf.Variable, epsilon: float) -> tf.Tensor:
    """LayerNorm over the last axis, in float32 (biased variance, as torch.nn.LayerNorm)."""
    x = tf.cast(x, tf.float32)
    mean, variance = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + epsilon) * weight + bias


def gelu_tanh(x: tf.Tensor) -> tf.Tensor:
    """GELU's tanh approximation (transformers' `gelu_new`, PyTorch's `gelu(approximate="tanh")`)."""
    return 0.5 * x * (1.0 + tf.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * tf.pow(x, 3))))


def rms_norm(x: tf.Tensor, weight: tf.Variable, epsilon: float) -> tf.Tensor:
    """RMSNorm over the last axis in float32 (Llama's: x / sqrt(mean(x^2) + eps), times the weight)."""
    x = tf.cast(x, tf.float32)
    return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + epsilon) * weight


def swiglu(gate: tf.Tensor, up: tf.Tensor) -> tf.Tensor:
    """SiLU(gate) * up, the gated MLP of Llama and Qwen2."""
    return tf.nn.silu(gate) * up


def linear(x: tf.Tensor, weight: tf.Variable, bias: tf.Variable | None, compute_dtype: tf.DType, *,
           out_in: bool = False) -> tf.Tensor:
    """x @ W + b in `compute_dtype`, every decoder's projection: the weight laid out [in, out] (Hugging Face's
    Conv1D, GPT-2) or, with `out_in`, [out, in] (torch.nn.Linear, Llama and Qwen2); no bias when `bias` is None."""
    projected = tf.matmul(tf.cast(x, compute_dtype), tf.cast(weight, compute_dtype), transpose_b=out_in)
    return projected if bias is None else projected + tf.cast(bias, compute_dtype)


def rotary_tables(inverse_frequencies, length: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """cos and sin [length, head_dim] of positions 0..length-1 at the given inverse frequencies, each half repeated
    (transformers' layout: the two halves of a head rotate together)."""
    angles = tf.cast(tf.range(length), tf.float32)[:, None] * tf.constant(inverse_frequencies, tf.float32)[None, :]
    angles = tf.concat([angles, angles], axis=-1)
    return tf.cos(angles), tf.sin(angles)


def apply_rotary(x: tf.Tensor, cos: tf.Tensor, sin: tf.Tensor) -> tf.Tensor:
    """Rotate [batch, heads, time, head_dim] by the tables (x * cos + rotate_half(x) * sin), in x's dtype."""
    first, second = tf.split(x, 2, axis=-1)
    rotated = tf.concat([-second, first], axis=-1)
    return x * tf.cast(cos, x.dtype) + rotated * tf.cast(sin, x.dtype)


def repeat_kv(x: tf.Tensor, groups: int) -> tf.Tensor:
    """Grouped-query attention's keys or values [batch, kv_heads, time, dim] repeated for each query head they
    serve: [batch, kv_heads * groups, time, dim], head h reading kv head h // groups (transformers' repeat_kv)."""
    return x if groups == 1 else tf.repeat(x, groups, axis=1)


def causal_attention(query: tf.Tensor, key: tf.Tensor, value: tf.Tensor, scale: float,
                     scores_in_float32: bool = False) -> tf.Tensor:
    """softmax(q k^T * scale, causal) v over [batch, heads, time, head_dim]. A position sees itself and the earlier
    ones; the others get the float32 minimum before the softmax (PyTorch's mask value; -1e4 would leak weight into
    the masked positions). The softmax runs in float32; `scores_in_float32` computes q k^T in float32 too."""
    if scores_in_float32:
        scores = tf.matmul(tf.cast(query, tf.float32), tf.cast(key, tf.float32), transpose_b=True) * scale
    else:
        scores = tf.cast(tf.matmul(query, key, transpose_b=True) * tf.cast(scale, query.dtype), tf.float32)
    length = tf.shape(scores)[-1]
    visible = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
    scores = tf.where(visible, scores, tf.float32.min)
    weights = tf.cast(tf.nn.softmax(scores, axis=-1), value.dtype)
    return tf.matmul(weights, value)


def token_losses(model, tokens: tf.Tensor) -> tf.Tensor:
    """Next-token cross-entropy of every predicted token, float32 [batch, time - 1]: labels are the inputs shifted
    by one (what transformers' loss with labels = input_ids averages)."""
    logits = model(tokens)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tokens[:, 1:], logits=logits[:, :-1])


def causal_lm_loss(model, tokens: tf.Tensor) -> tf.Tensor:
    """Mean next-token cross-entropy over a batch of token sequences (`token_losses`, averaged)."""
    return tf.reduce_mean(token_losses(model, tokens))


def count_parameters(model) -> int:
    """The model's weights, the tied head counted once (as PyTorch's `num_parameters()`), a frozen base's too;
    LoRA's adapters not."""
    return int(sum(math.prod(variable.shape) for variable in model.weights.values()))


def flops_per_token(model, block_size: int) -> float:
    """Training FLOPs per token, as in PaLM appendix B / nanoGPT: 6N for trained weights (forward, and the gradients
    of the inputs and of the weights) plus attention. A frozen base under LoRA takes 4N (no weight gradients) and
    its adapters 6 per trained parameter."""
    config = model.config
    attention = 12 * config.n_layer * config.n_head * config.head_width * block_size
    if model.adapters is None:
        return 6 * count_parameters(model) + attention
    return 4 * count_parameters(model) + 6 * model.adapters.plan.parameters + attention
