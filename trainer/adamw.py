"""AdamW in TensorFlow's core API, computed as `torch.optim.AdamW` computes it, for training under tf.distribute.

For each variable, at update t = 1, 2, ... with that update's learning rate lr:

    param *= 1 - lr * weight_decay                          (skipped for biases and LayerNorms: `decays`)
    m = m + (1 - beta_1) * (g - m)
    v = beta_2 * v + (1 - beta_2) * g**2
    param -= lr / (1 - beta_1**t) * m / (sqrt(v) / sqrt(1 - beta_2**t) + epsilon)

The Adam part is TensorFlow's fused `ResourceApplyAdam` (one pass over the variable and both moments, on CPU, GPU
and under XLA). That op, like tf-keras' AdamW, adds epsilon to sqrt(v) before the bias correction, which acts as an
epsilon 1 / sqrt(1 - beta_2**t) times PyTorch's (4.5x at the first step with beta_2 = 0.95); it is given
epsilon * sqrt(1 - beta_2**t) instead, which is PyTorch's update exactly (up to rounding).

Distribution: the optimizer is made inside the strategy scope of its variables, so its moments are mirrored like
them (float32, on the same devices). `apply_gradients` is called in the replica context with gradients already
summed over the workers (trainer/allreduce.py): each replica updates its own copies, with no merge_call and no
collective, so the copies stay equal and the update compiles with XLA. The variables must have no aggregation
(tf.Variable's default), or a replica's update would be combined with the others'.

Checkpoints: the optimizer is a `tf.Module` whose `iterations` and moments (keyed by variable name) a
`tf.train.Checkpoint` saves and restores, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tensorflow as tf

from trainer.optim import NO_DECAY_NAMES

# GPT-2/3's betas and PyTorch's epsilon.
BETA_1 = 0.9
BETA_2 = 0.95
EPSILON = 1e-8

LearningRate = float | Callable[[tf.Tensor], tf.Tensor]


def variable_name(variable: tf.Variable) -> str:
    """The name a variable is known by: `transformer.h.0.attn.c_attn.weight`, without TF's `:0`."""
    return variable.name.rsplit(":", 1)[0]


def decays(name: str, no_decay_names: Sequence[str] = NO_DECAY_NAMES) -> bool:
    """Whether weight decay applies to the variable `name`: not when one of `no_decay_names` occurs in it (biases,
    LayerNorm scales and offsets), the rule tf-keras' `exclude_from_weight_decay(var_names=...)` applies."""
    return not any(re.search(pattern, name) for pattern in no_decay_names)


@dataclass(frozen=True)
class _Target:
    """One variable and its moments (a plain object: the module tracks the moments by name, not through this)."""

    variable: tf.Variable
    name: str
    first_moment: tf.Variable
    second_moment: tf.Variable
    decays: bool


class AdamW(tf.Module):
    """AdamW with decoupled weight decay over a fixed list of float32 variables; make it in the strategy scope.

    `learning_rate`: a float, or a schedule called with `iterations` (int64: the updates applied so far) that
    returns a float32 scalar. `iterations` does not count a step that a loss scale skipped (trainer/precision.py).
    """

    # torch.optim.AdamW's hyperparameters, one keyword each, as its callers and its parity test name them.
    def __init__(self, variables: Sequence[tf.Variable], learning_rate: LearningRate, *, weight_decay: float,  # noqa: PLR0913
                 beta_1: float = BETA_1, beta_2: float = BETA_2, epsilon: float = EPSILON,
                 no_decay_names: Sequence[str] = NO_DECAY_NAMES, name: str = "adamw") -> None:
        super().__init__(name=name)
        check_variables(variables)
        self.learning_rate = learning_rate
        self.weight_decay, self.beta_1, self.beta_2, self.epsilon = weight_decay, beta_1, beta_2, epsilon
        strategy = tf.distribute.get_strategy()
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name="iterations")
        self.first_moments: dict[str, tf.Variable] = {}
        self.second_moments: dict[str, tf.Variable] = {}
        targets = []
        for variable in variables:
            key = variable_name(variable)
            with strategy.extended.colocate_vars_with(variable):
                self.first_moments[key] = _zeros_like(variable, f"{key}/m")
                self.second_moments[key] = _zeros_like(variable, f"{key}/v")
            targets.append(_Target(variable, key, self.first_moments[key], self.second_moments[key],
                                   decays(key, no_decay_names)))
        self._targets = tuple(targets)

    @property
    def variable_names(self) -> list[str]:
        return [target.name for target in self._targets]

    def current_learning_rate(self) -> tf.Tensor:
        """The learning rate the next update uses (float32)."""
        if callable(self.learning_rate):
            return tf.cast(self.learning_rate(self.iterations.read_value()), tf.float32)
        return tf.constant(self.learning_rate, tf.float32)

    def apply_gradients(self, gradients: Sequence[tf.Tensor | tf.IndexedSlices]) -> tf.Tensor:
        """One update with `gradients` (in the order of the variables given at construction); returns the learning
        rate it used. Call in the replica context (inside `strategy.run`, or with no strategy)."""
        if tf.distribute.in_cross_replica_context():
            raise RuntimeError("AdamW.apply_gradients runs in the replica context: call it inside strategy.run, "
                               "with the gradients already all-reduced.")
        if len(gradients) != len(self._targets):
            raise ValueError(f"AdamW.apply_gradients got {len(gradients)} gradients for {len(self._targets)} "
                             "variables: pass one per variable, in the order the optimizer was made with.")
        learning_rate = self.current_learning_rate()
        step = tf.cast(self.iterations + 1, tf.float32)
        beta_1_power, beta_2_power = tf.pow(self.beta_1, step), tf.pow(self.beta_2, step)
        # PyTorch's denominator sqrt(v) / sqrt(1 - beta_2**t) + epsilon, times sqrt(1 - beta_2**t), is the fused
        # op's sqrt(v) + epsilon * sqrt(1 - beta_2**t): the same update in one pass over the variable and moments.
        fused_epsilon = self.epsilon * tf.sqrt(1.0 - beta_2_power)
        decay_factor = 1.0 - learning_rate * self.weight_decay
        for target, gradient in zip(self._targets, gradients):
            gradient = _dense_float32(gradient, target.name)
            if target.decays:
                target.variable.assign(target.variable * decay_factor)
            tf.raw_ops.ResourceApplyAdam(
                var=target.variable.handle, m=target.first_moment.handle, v=target.second_moment.handle,
                beta1_power=beta_1_power, beta2_power=beta_2_power, lr=learning_rate, beta1=self.beta_1,
                beta2=self.beta_2, epsilon=fused_epsilon, grad=gradient)
        self.iterations.assign_add(1)
        return learning_rate


def check_variables(variables: Sequence[tf.Variable]) -> None:
    """Refuse what the update cannot serve: no variables, a name twice, a dtype other than float32 (the master
    weights), an aggregation (replicas update their own copies), or variables of another strategy's scope."""
    if not variables:
        raise ValueError("AdamW needs at least one variable to train.")
    strategy = tf.distribute.get_strategy()
    seen: set[str] = set()
    for variable in variables:
        name = variable_name(variable)
        if name in seen:
            raise ValueError(f"two variables are named {name!r}: AdamW keys its moments (and the checkpoint) by "
                             "name, so every trainable variable needs its own.")
        seen.add(name)
        if variable.dtype != tf.float32:
            raise ValueError(f"variable {name!r} is {variable.dtype.name}: the trained weights stay float32 "
                             "(mixed precision casts them where they are used, trainer/precision.py).")
        if variable.aggregation != tf.VariableAggregation.NONE:
            raise ValueError(f"variable {name!r} has aggregation {variable.aggregation.name}: AdamW applies "
                             "gradients that are already all-reduced, so create it with the default (NONE).")
        owner = getattr(variable, "distribute_strategy", None)  # only a distributed variable has one
        if owner is not (strategy if tf.distribute.has_strategy() else None):
            raise ValueError(f"variable {name!r} belongs to another distribution strategy than the one in scope: "
                             "make the optimizer inside the `strategy.scope()` that made the model.")


def _zeros_like(variable: tf.Variable, name: str) -> tf.Variable:
    return tf.Variable(tf.zeros(variable.shape, tf.float32), trainable=False, name=name)


def _dense_float32(gradient: tf.Tensor | tf.IndexedSlices | None, name: str) -> tf.Tensor:
    """The gradient as a dense float32 tensor (an embedding's lookup gives IndexedSlices)."""
    if gradient is None:
        raise ValueError(f"variable {name!r} got no gradient: it does not take part in the loss. Train only the "
                         "variables the loss depends on.")
    gradient = tf.convert_to_tensor(gradient)
    if gradient.dtype != tf.float32:
        raise ValueError(f"the gradient of {name!r} is {gradient.dtype.name}: cast it back to float32 after the "
                         "all-reduce, as trainer/allreduce.py does.")
    return gradient
