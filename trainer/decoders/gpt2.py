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
import hashlib
import math
from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf

from trainer.decoders import ops
from trainer.decoders.gpt2_config import GPT2Config, parameter_shapes
from trainer.decoders.recompute import recomputed

# name, shape -> the variable's initial value
Initializer = Callable[[str, tuple[int, ...]], "tf.Tensor | np.ndarray"]
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


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


def name_seed(seed: int, name: str) -> tf.Tensor:
    """A stateless-RNG seed for the tensor `name`: the run's seed and a stable digest of the name."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return tf.constant([seed, digest], tf.int64)


def zeros_init(name: str, shape: tuple[int, ...]) -> tf.Tensor:
    """For a model whose weights are assigned right after (a checkpoint's): nothing to draw."""
    return tf.zeros(shape)


class GPT2Decoder(tf.Module):
    """GPT2LMHeadModel's forward pass: int token ids [batch, time] -> float32 logits [batch, time, vocab].

    `weights` maps each state-dict name (`transformer.wte.weight`, `transformer.h.0.attn.c_attn.weight`, ...) to
    its float32 variable, in PyTorch's order. `compute_dtype` (float32, bfloat16, float16) is what the matmuls
    run in; see trainer/decoders/ops.py.
    """

    def __init__(self, config: GPT2Config, *, compute_dtype: str = "float32", initializer: Initializer | None = None,
                 seed: int = 0, name: str = "gpt2") -> None:
        super().__init__(name=name)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype {compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}.")
        self.config = config
        self.compute_dtype = tf.as_dtype(compute_dtype)
        initial_value = initializer or random_init(config, seed)
        # A list keeps PyTorch's order (a tracked dict would be walked in sorted key order); checkpoints key each
        # variable by its position, which the config fixes.
        self._variables = [tf.Variable(initial_value(key, shape), name=key, dtype=tf.float32)
                           for key, shape in parameter_shapes(config).items()]
        self._names = tuple(parameter_shapes(config))
        self.adapters = None  # trainer/lora.py's LoraAdapters once attached: their output joins the projections'
        self.recompute = False  # recompute each block's activations in the backward pass (recomputed)

    @property
    def weights(self) -> Mapping[str, tf.Variable]:
        """State-dict name -> variable, in the order PyTorch's GPT2LMHeadModel lists its parameters."""
        return dict(zip(self._names, self._variables, strict=True))

    def freeze(self, dtype: str = "float32") -> None:
        """Make the weights constants of training: tensors, not variables, so they get no gradient, no optimizer
        state, no checkpoint entry and no broadcast between workers (each worker built the same values, which
        depend on the seed or the checkpoint only). The matrices are stored in `dtype` (bfloat16 halves them; the
        matmuls cast them to the compute dtype anyway); LayerNorms and biases stay float32. Each weight is replaced
        in turn, so the host holds one weight twice at most."""
        for index, variable in enumerate(self._variables):
            stored = tf.as_dtype(dtype) if variable.shape.rank == 2 else tf.float32
            self._variables[index] = tf.cast(tf.convert_to_tensor(variable), stored)

    def __call__(self, input_ids: tf.Tensor) -> tf.Tensor:
        weights = self.weights
        config = self.config
        input_ids = tf.convert_to_tensor(input_ids)
        length = tf.shape(input_ids)[1]
        x = (tf.cast(tf.gather(weights["transformer.wte.weight"], input_ids), tf.float32)
             + tf.cast(weights["transformer.wpe.weight"][:length], tf.float32))
        for layer in range(config.n_layer):
            x = recomputed(functools.partial(self._block, weights=weights, layer=layer), self.recompute)(x)
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

    def _linear(self, x: tf.Tensor, weights: Mapping[str, tf.Variable], module: str) -> tf.Tensor:
        """The projection `module` (`transformer.h.0.attn.c_attn`), plus its adapter's output when it has one."""
        y = ops.linear(x, weights[module + ".weight"], weights[module + ".bias"], self.compute_dtype)
        if self.adapters is not None and module in self.adapters.modules:
            y += self.adapters.delta(module, x, y.dtype)
        return y

    def _attention(self, h: tf.Tensor, weights: Mapping[str, tf.Variable], prefix: str, layer: int) -> tf.Tensor:
        config = self.config
        batch, length = tf.shape(h)[0], tf.shape(h)[1]
        qkv = self._linear(h, weights, prefix + "attn.c_attn")
        heads = [tf.transpose(tf.reshape(part, [batch, length, config.n_head, config.head_dim]), [0, 2, 1, 3])
                 for part in tf.split(qkv, 3, axis=-1)]
        scale = 1.0 / math.sqrt(config.head_dim) if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= layer + 1
        merged = ops.causal_attention(*heads, scale, scores_in_float32=config.reorder_and_upcast_attn)
        merged = tf.reshape(tf.transpose(merged, [0, 2, 1, 3]), [batch, length, config.n_embd])
        return self._linear(merged, weights, prefix + "attn.c_proj")

    def _mlp(self, h: tf.Tensor, weights: Mapping[str, tf.Variable], prefix: str) -> tf.Tensor:
        h = self._linear(h, weights, prefix + "mlp.c_fc")
        return self._linear(ops.gelu_tanh(h), weights, prefix + "mlp.c_proj")
