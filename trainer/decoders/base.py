"""What every decoder architecture shares: float32 `tf.Variable`s named and shaped as PyTorch's state dict, a frozen
base (trainer/lora.py), the projections with their LoRA adapters, and recomputed blocks. Each architecture (gpt2.py,
llama.py) adds its forward pass, calling `_project` for every projection and running each block through `_block_fn`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf

from trainer.decoders import ops

# name, shape -> the variable's initial value
Initializer = Callable[[str, tuple[int, ...]], "tf.Tensor | np.ndarray"]
Block = Callable[[tf.Tensor], tf.Tensor]  # one block: the residual stream in, out
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


def name_seed(seed: int, name: str) -> tf.Tensor:
    """A stateless-RNG seed for the tensor `name`: the run's seed and a stable digest of the name."""
    digest = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    return tf.constant([seed, digest], tf.int64)


def zeros_init(name: str, shape: tuple[int, ...]) -> tf.Tensor:
    """For a model whose weights are assigned right after (a checkpoint's): nothing to draw."""
    return tf.zeros(shape)


class Decoder(tf.Module):
    """A decoder's weights and memory settings. `weights` maps each state-dict name to its float32 variable (a tensor
    once frozen), in PyTorch's order; `compute_dtype` (float32, bfloat16, float16) is what the matmuls run in."""

    # How the projections' weights are laid out: [out, in] (torch.nn.Linear), or [in, out] (GPT-2's Conv1D).
    weights_out_in: bool = True

    def __init__(self, config, shapes: Mapping[str, tuple[int, ...]], initial_value: Initializer, *,
                 compute_dtype: str, name: str) -> None:
        super().__init__(name=name)
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype {compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}.")
        self.config = config
        self.compute_dtype = tf.as_dtype(compute_dtype)
        # A list keeps PyTorch's order (a tracked dict would be walked in sorted key order); checkpoints key each
        # variable by its position, which the config fixes.
        self._variables = [tf.Variable(initial_value(key, shape), name=key, dtype=tf.float32)
                           for key, shape in shapes.items()]
        self._names = tuple(shapes)
        self.adapters = None  # trainer/lora.py's LoraAdapters once attached: their output joins the projections'
        self.recompute = False  # recompute each block's activations in the backward pass (_block_fn)

    @property
    def weights(self) -> Mapping[str, tf.Variable]:
        """State-dict name -> variable, in the order PyTorch lists the model's parameters."""
        return dict(zip(self._names, self._variables, strict=True))

    def freeze(self, dtype: str = "float32") -> None:
        """Make the weights constants of training: tensors, not variables, so they get no gradient, no optimizer
        state, no checkpoint entry and no broadcast between workers (each worker built the same values, which
        depend on the seed or the checkpoint only). The matrices are stored in `dtype` (bfloat16 halves them; the
        matmuls cast them to the compute dtype anyway); norms and biases stay float32. Each weight is replaced
        in turn, so the host holds one weight twice at most."""
        for index, variable in enumerate(self._variables):
            stored = tf.as_dtype(dtype) if variable.shape.rank == 2 else tf.float32
            self._variables[index] = tf.cast(tf.convert_to_tensor(variable), stored)

    def _project(self, x: tf.Tensor, weights: Mapping[str, tf.Variable], module: str) -> tf.Tensor:
        """The projection `module` (`model.layers.0.self_attn.q_proj`) of `x`, its bias where it has one, plus its
        adapter's output when it has one."""
        y = ops.linear(x, weights[module + ".weight"], weights.get(module + ".bias"), self.compute_dtype,
                       out_in=self.weights_out_in)
        if self.adapters is not None and module in self.adapters.modules:
            return y + self.adapters.delta(module, x, y.dtype)
        return y

    def _block_fn(self, block: Block) -> Block:
        """`block`, recomputed in the backward pass when the run asks for it: the backward pass runs its forward
        again instead of keeping its intermediate activations, so it holds only its input between the passes. The
        gradients reach the trainable variables it reads (tf.recompute_grad watches them), frozen ones get none."""
        return tf.recompute_grad(block) if self.recompute else block
