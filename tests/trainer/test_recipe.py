"""trainer.recipe: the schedule equals tf_keras' recorded rates, global-norm clipping, seeds.

fixtures/keras_recipe.json was recorded from the tf-keras path (fixtures/record_keras_recipe.py) before it left.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow as tf

from trainer.optim import GRAD_CLIP_NORM
from trainer.recipe import WarmupCosine, clip_gradients, learning_rate_schedule, set_random_seed

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "keras_recipe.json").read_text())


@pytest.mark.parametrize("run", RECORDED["schedules"], ids=lambda r: f"lr{r['learning_rate']}-w{r['warmup_steps']}"
                         f"-max{r['max_steps']}")
def test_schedule_equals_the_recorded_tf_keras_rates(run):
    """Every step's rate, bit for bit, eager and inside a tf.function on the optimizer's int64 step."""
    schedule = learning_rate_schedule(SimpleNamespace(**{k: run[k] for k in ("learning_rate", "warmup_steps",
                                                                            "max_steps")}))
    steps = range(len(run["rates"]))
    eager = [float(schedule(tf.constant(step, tf.int64))) for step in steps]
    traced = tf.function(lambda step: schedule(step))
    assert eager == run["rates"]
    assert [float(traced(tf.constant(step, tf.int64))) for step in steps] == run["rates"]


def test_schedule_shape():
    """From peak / (warmup + 1) up to the peak, down to a tenth of it at max_steps, flat after."""
    schedule = learning_rate_schedule(SimpleNamespace(learning_rate=1e-3, warmup_steps=9, max_steps=109))
    assert float(schedule(0)) == pytest.approx(1e-4)
    assert float(schedule(9)) == pytest.approx(1e-3)
    assert float(schedule(59)) == pytest.approx(0.55e-3)
    assert float(schedule(109)) == float(schedule(500)) == pytest.approx(1e-4)


def test_schedule_refuses_nonsense():
    with pytest.raises(ValueError, match="needs peak > 0"):
        WarmupCosine(peak=0.0, warmup_steps=0, decay_steps=10)
    with pytest.raises(ValueError, match="decay_steps >= 1"):
        WarmupCosine(peak=1e-3, warmup_steps=0, decay_steps=0)


def test_clip_scales_all_gradients_together():
    gradients = [tf.constant([3.0, 0.0]), tf.constant([[0.0], [4.0]])]  # global norm 5
    clipped, norm = clip_gradients(gradients)
    assert float(norm) == pytest.approx(5.0)
    assert float(tf.linalg.global_norm(clipped)) == pytest.approx(GRAD_CLIP_NORM)
    np.testing.assert_allclose(clipped[0].numpy(), [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped[1].numpy(), [[0.0], [0.8]], rtol=1e-6)


def test_clip_leaves_small_gradients_and_poisons_non_finite_ones():
    small = [tf.constant([0.3, 0.4])]
    clipped, norm = clip_gradients(small)
    assert float(norm) == pytest.approx(0.5)
    np.testing.assert_array_equal(clipped[0].numpy(), small[0].numpy())
    poisoned, _ = clip_gradients([tf.constant([1.0, np.inf]), tf.constant([2.0])])
    assert all(np.isnan(g.numpy()).all() for g in poisoned)  # a loss scale then skips the step


def test_seeds_draw_what_tf_keras_drew():
    recorded = RECORDED["seeds"]
    set_random_seed(recorded["seed"])
    assert random.random() == recorded["python"]
    assert float(np.random.random()) == recorded["numpy"]
    assert tf.random.uniform([3]).numpy().tolist() == recorded["tensorflow"]


def test_seeds_repeat_and_differ():
    def draws(seed: int) -> tuple:
        set_random_seed(seed)
        return random.random(), float(np.random.random()), tf.random.normal([2]).numpy().tolist()

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    with pytest.raises(TypeError, match="seed must be an integer"):
        set_random_seed(1.5)
