"""LoRA adapters on a frozen decoder, computed as PEFT computes them: a projection y = x W + b gains
(x A^T) B^T * alpha / r, with A [r, in] and B [out, r] laid out as PEFT's nn.Linear pair whatever the base's layout.
A starts as PEFT's (Kaiming-uniform, bound 1/sqrt(in)), B at zero, so training starts from the base model exactly.

Only the adapters are trainable variables: the optimizer, the gradients' all-reduce and the checkpoint see them
alone; the base's variables are never assigned, so they stay bit for bit what was loaded. The merged model
(W + scaling * (B A), transposed for GPT-2's [in, out] Conv1D) is what the serving exports and their parity gates
check; the adapter itself is written in PEFT's layout (trainer/adapter_export.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from trainer.decoders.base import name_seed
from trainer.lora_plan import LoraPlan

PEFT_PREFIX = "base_model.model."


def peft_key(module: str, matrix: str) -> str:
    """PEFT's state-dict key of one adapter matrix: `base_model.model.<module>.lora_A.weight`."""
    return f"{PEFT_PREFIX}{module}.lora_{matrix}.weight"


class LoraAdapters(tf.Module):
    """The adapters of `plan`'s modules, float32 variables named by their PEFT keys (in the plan's order, A then B
    for each module). Make inside the strategy scope that made the model."""

    def __init__(self, plan: LoraPlan, *, seed: int, name: str = "lora") -> None:
        super().__init__(name=name)
        self.plan = plan
        self.modules = frozenset(module.path for module in plan.modules)
        self._variables = []
        for module in plan.modules:
            bound = 1.0 / math.sqrt(module.in_features)
            key_a, key_b = peft_key(module.path, "A"), peft_key(module.path, "B")
            self._variables.append(tf.Variable(tf.random.stateless_uniform(
                [plan.rank, module.in_features], seed=name_seed(seed, key_a), minval=-bound, maxval=bound),
                name=key_a))
            self._variables.append(tf.Variable(tf.zeros([module.out_features, plan.rank]), name=key_b))
        # Positions, not variables: a second container of them would change the order the module lists them in.
        self._index = {module.path: 2 * i for i, module in enumerate(plan.modules)}

    @property
    def tensors(self) -> Mapping[str, tf.Variable]:
        """PEFT key -> variable, in the plan's order."""
        return {variable.name.rsplit(":", 1)[0]: variable for variable in self._variables}

    def pair(self, module: str) -> tuple[tf.Variable, tf.Variable]:
        """The (A, B) variables of the projection `module`."""
        index = self._index[module]
        return self._variables[index], self._variables[index + 1]

    def delta(self, module: str, x: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
        """The adapter's output for the projection `module` of input `x` [..., in], computed in `dtype`."""
        lora_a, lora_b = self.pair(module)
        hidden = tf.matmul(tf.cast(x, dtype), tf.cast(lora_a, dtype), transpose_b=True)
        return tf.matmul(hidden, tf.cast(lora_b, dtype), transpose_b=True) * tf.cast(self.plan.scaling, dtype)

    def weight_delta(self, module: str) -> np.ndarray:
        """scaling * (B A), laid out as the base's weight ([in, out] when `fan_in_fan_out`), float32."""
        lora_a, lora_b = (tf.convert_to_tensor(v).numpy() for v in self.pair(module))
        delta = (lora_b @ lora_a) * np.float32(self.plan.scaling)
        return delta.T if self.plan.fan_in_fan_out else delta


def attach_lora(model, plan: LoraPlan, *, seed: int, base_dtype: str = "float32") -> LoraAdapters:
    """Freeze `model`'s weights (stored in `base_dtype`) and give it `plan`'s adapters; call inside the strategy
    scope that made it. Returns the adapters (also `model.adapters`)."""
    model.freeze(base_dtype)
    model.adapters = LoraAdapters(plan, seed=seed)
    return model.adapters


def merged_weights(model) -> dict[str, np.ndarray]:
    """Every weight of `model` as float32 arrays, each adapted projection's weight merged with its adapter."""
    adapters = model.adapters
    merged = {}
    for name, variable in model.weights.items():
        value = tf.cast(tf.convert_to_tensor(variable), tf.float32).numpy()
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in adapters.modules:
            value = value + adapters.weight_delta(module)
        merged[name] = value
    return merged


def merged_decoder(model):
    """A plain float32 decoder (no strategy, no adapters) holding `model`'s merged weights: what the model directory
    and the serving exports hold. Call outside the strategy's scope."""
    from trainer.decoders.base import zeros_init
    from trainer.decoders.pretrained import build_decoder

    copy = build_decoder(model.config, compute_dtype="float32", initializer=zeros_init)
    for name, value in merged_weights(model).items():
        copy.weights[name].assign(value)
    return copy
