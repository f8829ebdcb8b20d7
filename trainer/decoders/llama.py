"""Llama and Qwen2 (Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM) in TensorFlow's core API: a `tf.Module` of
float32 `tf.Variable`s named and shaped as PyTorch's state dict, read and written name for name as GPT-2's are.

Pre-RMSNorm blocks, rotary positions (default, linear or llama3 frequencies), grouped-query attention, a SwiGLU MLP,
nn.Linear weights laid out [out, in], optional biases (Llama's `attention_bias` / `mlp_bias`, Qwen2's q/k/v), and
a head tied to the token embedding or its own. No dropout, as GPT2Decoder. Within `config.n_positions` tokens
Qwen2's sliding window sees every earlier token, so its attention is the plain causal one (the config refuses a
block size beyond it).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import tensorflow as tf

from trainer.decoders import ops
from trainer.decoders.base import Decoder, Initializer, name_seed
from trainer.decoders.llama_config import LlamaConfig, inverse_frequencies, parameter_shapes


def random_init(config: LlamaConfig, seed: int) -> Initializer:
    """transformers' `_init_weights` for these models: weights and embeddings normal(0, initializer_range), biases
    zero, RMSNorm weights one. Each tensor's values depend on the seed and its name only."""

    def initial_value(name: str, shape: tuple[int, ...]) -> tf.Tensor:
        if name.endswith(".bias"):
            return tf.zeros(shape)
        if name.endswith("norm.weight"):
            return tf.ones(shape)
        return tf.random.stateless_normal(shape, seed=name_seed(seed, name), stddev=config.initializer_range)

    return initial_value


class LlamaDecoder(Decoder):
    """LlamaForCausalLM's / Qwen2ForCausalLM's forward pass: int token ids [batch, time] -> float32 logits
    [batch, time, vocab]. `weights` maps each state-dict name to its float32 variable, in PyTorch's order
    (trainer/decoders/base.py); `compute_dtype` is what the matmuls run in (ops.py)."""

    def __init__(self, config: LlamaConfig, *, compute_dtype: str = "float32", initializer: Initializer | None = None,
                 seed: int = 0, name: str = "llama") -> None:
        super().__init__(config, parameter_shapes(config), initializer or random_init(config, seed),
                         compute_dtype=compute_dtype, name=name)
        self._inverse_frequencies = inverse_frequencies(config)

    def __call__(self, input_ids: tf.Tensor) -> tf.Tensor:
        weights = self.weights
        config = self.config
        input_ids = tf.convert_to_tensor(input_ids)
        cos, sin = ops.rotary_tables(self._inverse_frequencies, tf.shape(input_ids)[1])
        x = tf.cast(tf.gather(weights["model.embed_tokens.weight"], input_ids), tf.float32)
        for layer in range(config.num_hidden_layers):
            block = functools.partial(self._block, weights=weights, prefix=f"model.layers.{layer}.", cos=cos, sin=sin)
            x = self._block_fn(block)(x)
        x = ops.rms_norm(x, weights["model.norm.weight"], config.rms_norm_eps)
        head = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        return tf.cast(ops.linear(x, head, None, self.compute_dtype, out_in=True), tf.float32)

    def _block(self, x: tf.Tensor, *, weights: Mapping[str, tf.Variable], prefix: str, cos: tf.Tensor,
               sin: tf.Tensor) -> tf.Tensor:
        """The block under `prefix` (`model.layers.0.`): the residual stream after its attention and MLP."""
        epsilon = self.config.rms_norm_eps
        h = ops.rms_norm(x, weights[prefix + "input_layernorm.weight"], epsilon)
        x = x + tf.cast(self._attention(h, weights, prefix + "self_attn.", cos, sin), tf.float32)
        h = ops.rms_norm(x, weights[prefix + "post_attention_layernorm.weight"], epsilon)
        return x + tf.cast(self._mlp(h, weights, prefix + "mlp."), tf.float32)

    def _attention(self, h: tf.Tensor, weights: Mapping[str, tf.Variable], prefix: str, cos: tf.Tensor,
                   sin: tf.Tensor) -> tf.Tensor:
        config = self.config
        batch, length, width = tf.shape(h)[0], tf.shape(h)[1], config.head_width

        def heads(name: str, count: int) -> tf.Tensor:
            projected = self._project(h, weights, prefix + name)
            return tf.transpose(tf.reshape(projected, [batch, length, count, width]), [0, 2, 1, 3])

        query = ops.apply_rotary(heads("q_proj", config.num_attention_heads), cos, sin)
        key = ops.apply_rotary(heads("k_proj", config.kv_heads), cos, sin)
        groups = config.num_attention_heads // config.kv_heads
        merged = ops.causal_attention(query, ops.repeat_kv(key, groups),
                                      ops.repeat_kv(heads("v_proj", config.kv_heads), groups), width ** -0.5)
        merged = tf.reshape(tf.transpose(merged, [0, 2, 1, 3]), [batch, length, config.num_attention_heads * width])
        return self._project(merged, weights, prefix + "o_proj")

    def _mlp(self, h: tf.Tensor, weights: Mapping[str, tf.Variable], prefix: str) -> tf.Tensor:
        gate, up = (self._project(h, weights, prefix + name) for name in ("gate_proj", "up_proj"))
        gated = ops.swiglu(gate, up)
        return self._project(gated, weights, prefix + "down_proj")
