"""trainer.precision: low-precision compute over float32 weights, and fp16 loss scaling as tf_keras did it.

The loss-scale trajectory is compared with tf_keras' LossScaleOptimizer, recorded in fixtures/keras_recipe.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from trainer.adamw import AdamW
from trainer.precision import GROWTH_INTERVAL, INITIAL_LOSS_SCALE, LossScale, Precision

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "keras_recipe.json").read_text())["loss_scale"]


class TinyLayer(tf.Module):
    """A Conv1D-style layer that keeps float32 variables and computes in the run's dtype, as the decoder does."""

    def __init__(self, precision: Precision) -> None:
        super().__init__()
        self.precision = precision
        self.weight = tf.Variable(tf.random.stateless_normal([8, 4], seed=[1, 2]), name="h.0.mlp.c_fc.weight")
        self.bias = tf.Variable(tf.zeros([4]), name="h.0.mlp.c_fc.bias")

    def __call__(self, inputs: tf.Tensor) -> tf.Tensor:
        cast = self.precision.cast
        return tf.matmul(cast(inputs), cast(self.weight)) + cast(self.bias)


def float32_loss(layer: TinyLayer, inputs: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.square(tf.cast(layer(inputs), tf.float32)))


@pytest.mark.parametrize(("setting", "dtype", "policy", "scaled"), [
    ("no", tf.float32, "float32", False), ("bf16", tf.bfloat16, "mixed_bfloat16", False),
    ("fp16", tf.float16, "mixed_float16", True),
])
def test_settings(setting, dtype, policy, scaled):
    precision = Precision(setting)
    assert (precision.compute_dtype, precision.policy_name, precision.loss_scaling) == (dtype, policy, scaled)
    assert isinstance(precision.make_loss_scale(), LossScale) is scaled


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="mixed_precision 'fp8' is not one of"):
        Precision("fp8")


@pytest.mark.parametrize("setting", ["bf16", "fp16"])
def test_low_precision_compute_keeps_float32_weights(setting):
    """Activations in the low dtype; loss, gradients, moments and weights in float32; close to the float32 loss."""
    inputs = tf.random.stateless_normal([2, 8], seed=[3, 4])
    layer, reference = TinyLayer(Precision(setting)), TinyLayer(Precision("no"))
    assert layer(inputs).dtype == Precision(setting).compute_dtype
    with tf.GradientTape() as tape:
        loss = float32_loss(layer, inputs)
    gradients = tape.gradient(loss, [layer.weight, layer.bias])
    assert loss.dtype == tf.float32 and all(g.dtype == tf.float32 for g in gradients)
    assert float(loss) == pytest.approx(float(float32_loss(reference, inputs)), rel=2e-2)
    AdamW([layer.weight, layer.bias], 1e-2, weight_decay=0.1).apply_gradients(gradients)
    assert layer.weight.dtype == layer.bias.dtype == tf.float32


def test_defaults_are_tf_keras_loss_scale_optimizer_defaults():
    assert INITIAL_LOSS_SCALE == RECORDED["default_initial_scale"]
    assert GROWTH_INTERVAL == RECORDED["default_growth_interval"]
    assert float(LossScale().scale) == INITIAL_LOSS_SCALE


def test_scale_follows_tf_keras_over_finite_and_overflowing_steps():
    loss_scale = LossScale(growth_interval=RECORDED["growth_interval"])
    scales = []
    for finite in RECORDED["finite"]:
        loss_scale.update([tf.constant([0.5, 0.25] if finite else [0.5, np.inf])])
        scales.append(float(loss_scale.scale))
    assert scales == RECORDED["scales"]


def test_scale_never_drops_below_one_nor_grows_to_inf():
    tiny = LossScale(initial_scale=2.0)
    for _ in range(3):
        tiny.update([tf.constant([np.nan])])
    assert float(tiny.scale) == 1.0
    huge = LossScale(initial_scale=2.0**127, growth_interval=1)
    huge.update([tf.constant([1.0])])
    assert float(huge.scale) == 2.0**127 and int(huge.finite_steps) == 0


def test_scaling_round_trip_is_exact():
    loss_scale = LossScale()
    assert float(loss_scale.scale_loss(tf.constant(0.75))) == 0.75 * 2**15
    gradient = tf.constant([1e-3, -7.5, 3.0e-30])
    np.testing.assert_array_equal(loss_scale.unscale([gradient * 2**15])[0].numpy(), gradient.numpy())


def fp16_step(layer: TinyLayer, optimizer: AdamW, loss_scale: LossScale, inputs: tf.Tensor) -> bool:
    """One fp16 training step as the trainer takes it: scaled loss, unscaled gradients, apply if finite."""
    variables = [layer.weight, layer.bias]
    with tf.GradientTape() as tape:
        scaled = loss_scale.scale_loss(float32_loss(layer, inputs))
    gradients = loss_scale.unscale(tape.gradient(scaled, variables))
    return bool(loss_scale.apply_gradients(optimizer, gradients))


def test_fp16_overflow_halves_the_scale_and_skips_the_step():
    """Inputs of 40: the scaled loss's gradients pass float16's 65504 and become inf until the scale is small
    enough; each such step halves the scale and leaves weights, moments and the optimizer's step as they were."""
    layer = TinyLayer(Precision("fp16"))
    optimizer = AdamW([layer.weight, layer.bias], 1e-2, weight_decay=0.1)
    loss_scale = LossScale()
    inputs = tf.fill([2, 8], 40.0)
    before = layer.weight.numpy()
    applied = [fp16_step(layer, optimizer, loss_scale, inputs) for _ in range(3)]
    assert applied == [False, False, False]
    assert float(loss_scale.scale) == 2.0**12
    np.testing.assert_array_equal(layer.weight.numpy(), before)
    assert int(optimizer.iterations) == 0
    assert not np.any(optimizer.first_moments[optimizer.variable_names[0]].numpy())
    while not fp16_step(layer, optimizer, loss_scale, inputs):
        pass
    assert int(optimizer.iterations) == 1 and not np.array_equal(layer.weight.numpy(), before)
    assert np.isfinite(layer.weight.numpy()).all()


def test_scale_doubles_after_the_growth_interval():
    layer = TinyLayer(Precision("fp16"))
    optimizer = AdamW([layer.weight, layer.bias], 1e-3, weight_decay=0.0)
    loss_scale = LossScale(initial_scale=8.0, growth_interval=3)
    inputs = tf.random.stateless_normal([2, 8], seed=[5, 6])
    scales = []
    for _ in range(7):
        assert fp16_step(layer, optimizer, loss_scale, inputs)
        scales.append(float(loss_scale.scale))
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    assert int(optimizer.iterations) == 7


def test_compiled_skip_matches_eager():
    """The same decisions inside a tf.function compiled with XLA (tf.cond around the update)."""
    eager_weight, compiled_weight = (tf.Variable([1.0, 2.0], name="w.weight") for _ in range(2))
    eager, compiled = AdamW([eager_weight], 0.1, weight_decay=0.0), AdamW([compiled_weight], 0.1, weight_decay=0.0)
    eager_scale, compiled_scale = LossScale(growth_interval=2), LossScale(growth_interval=2)
    step = tf.function(lambda g: compiled_scale.apply_gradients(compiled, [g]), jit_compile=True)
    for values in ([1.0, np.inf], [0.5, 0.5], [np.nan, 0.0], [0.5, -0.5], [0.25, 1.0]):
        gradient = tf.constant(values, tf.float32)
        assert bool(step(gradient)) == bool(eager_scale.apply_gradients(eager, [gradient]))
    assert float(compiled_scale.scale) == float(eager_scale.scale)
    np.testing.assert_allclose(compiled_weight.numpy(), eager_weight.numpy(), rtol=1e-6)


def test_checkpoint_restores_the_scale_and_its_count(tmp_path):
    loss_scale = LossScale(growth_interval=5)
    for values in ([np.inf], [1.0], [1.0]):
        loss_scale.update([tf.constant(values)])
    saved = tf.train.Checkpoint(loss_scale=loss_scale).write(str(tmp_path / "ckpt"))
    restored = LossScale(growth_interval=5)
    tf.train.Checkpoint(loss_scale=restored).read(saved).assert_consumed()
    assert (float(restored.scale), int(restored.finite_steps)) == (2.0**14, 2)
