"""GPT-2 (Hugging Face's GPT2LMHeadModel) in TensorFlow's core API: a `tf.Module` of float32 `tf.Variable`s named
and shaped as PyTorch's state dict, so a checkpoint is read and written by copying tensors name for name.

Learned positions, pre-LayerNorm blocks, Conv1D weights laid out [in, out] (x @ W + b), scaled causal attention,
the tanh GELU and a head tied to the token embedding. There is no dropout: a run is a pure function of its seed and
data order, which lets a data-parallel run be compared step by step with its single-worker baseline.

Build it inside the strategy's scope (`strategy.scope()`): its variables are then the strategy's (mirrored).
`tf.train.Checkpoint(model=decoder)` saves and restores it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import tensorflow as tf

from trainer.decoders import ops
from trainer.decoders.base import Decoder, Initializer, name_seed
from trainer.decoders.gpt2_config import GPT2Config, parameter_shapes


def random_init(config: GPT2Config, seed: int) -> Initializer:
    """GPT-2's initialisation (transformers' `_init_weights`): weights and embeddings normal(0, initializer_range),
    each residual projection (`c_proj`) scaled by 1/sqrt(2 * n_layer), biases zero, LayerNorm weights one. Each
    tensor's values depend on the seed and its name only, so every worker draws the same model."""
    projection_std = config.initializer_range / math.sqrt(2 * config.n_layer)

    def initial_value(name: str, shape: tuple[int, ...]) -> tf.Tensor:
        if name.endswith(".bias"):
            return tf.zeros(shape)
        if ".ln_" in name:
            return tf.ones(shape)
        std = projection_std if name.endswith("c_proj.weight") else config.initializer_range
        return tf.random.stateless_normal(shape, seed=name_seed(seed, name), stddev=std)

    return initial_value


class GPT2Decoder(Decoder):
    """GPT2LMHeadModel's forward pass: int token ids [batch, time] -> float32 logits [batch, time, vocab].

    `weights` maps each state-dict name (`transformer.wte.weight`, `transformer.h.0.attn.c_attn.weight`, ...) to
    its float32 variable, in PyTorch's order (trainer/decoders/base.py); the matmuls run in `compute_dtype`
    (trainer/decoders/ops.py).
    """

    weights_out_in = False  # Conv1D: [in, out]

    def __init__(self, config: GPT2Config, *, compute_dtype: str = "float32", initializer: Initializer | None = None,
                 seed: int = 0, name: str = "gpt2") -> None:
        super().__init__(config, parameter_shapes(config), initializer or random_init(config, seed),
                         compute_dtype=compute_dtype, name=name)

    def __call__(self, input_ids: tf.Tensor) -> tf.Tensor:
        weights = self.weights
        config = self.config
        input_ids = tf.convert_to_tensor(input_ids)
        length = tf.shape(input_ids)[1]
        x = (tf.cast(tf.gather(weights["transformer.wte.weight"], input_ids), tf.float32)
             + tf.cast(weights["transformer.wpe.weight"][:length], tf.float32))
        for layer in range(config.n_layer):
            x = self._block_fn(functools.partial(self._block, weights=weights, layer=layer))(x)
        x = ops.layer_norm(x, weights["transformer.ln_f.weight"], weights["transformer.ln_f.bias"],
                           config.layer_norm_epsilon)
        head = tf.cast(weights["transformer.wte.weight"], self.compute_dtype)
        return tf.cast(tf.matmul(tf.cast(x, self.compute_dtype), head, transpose_b=True), tf.float32)

    def _block(self, x: tf.Tensor, *, weights: Mapping[str, tf.Variable], layer: int) -> tf.Tensor:
        """Block `layer`: the residual stream after its attention and MLP."""
        prefix, epsilon = f"transformer.h.{layer}.", self.config.layer_norm_epsilon
        h = ops.layer_norm(x, weights[prefix + "ln_1.weight"], weights[prefix + "ln_1.bias"], epsilon)
        x = x + tf.cast(self._attention(h, weights, prefix, layer), tf.float32)
        h = ops.layer_norm(x, weights[prefix + "ln_2.weight"], weights[prefix + "ln_2.bias"], epsilon)
        return x + tf.cast(self._mlp(h, weights, prefix), tf.float32)

    def _attention(self, h: tf.Tensor, weights: Mapping[str, tf.Variable], prefix: str, layer: int) -> tf.Tensor:
        config = self.config
        batch, length = tf.shape(h)[0], tf.shape(h)[1]
        qkv = self._project(h, weights, prefix + "attn.c_attn")
        heads = [tf.transpose(tf.reshape(part, [batch, length, config.n_head, config.head_dim]), [0, 2, 1, 3])
                 for part in tf.split(qkv, 3, axis=-1)]
        scale = 1.0 / math.sqrt(config.head_dim) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        merged = ops.causal_attention(*heads, scale, scores_in_float32=config.reorder_and_upcast_attn)
        merged = tf.reshape(tf.transpose(merged, [0, 2, 1, 3]), [batch, length, config.n_embd])
        return self._project(merged, weights, prefix + "attn.c_proj")

    def _mlp(self, h: tf.Tensor, weights: Mapping[str, tf.Variable], prefix: str) -> tf.Tensor:
        h = self._project(h, weights, prefix + "mlp.c_fc")
        return self._project(ops.gelu_tanh(h), weights, prefix + "mlp.c_proj")
