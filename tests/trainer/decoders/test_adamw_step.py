"""One training step of the decoder against PyTorch's: the golden tiny GPT-2 loaded with load_pretrained, the loss
of the fixture's ids (labels = the ids) differentiated by the decoder and applied by trainer/adamw.py gives the
weights torch.optim.AdamW gave transformers 5's GPT2LMHeadModel (fixtures/gpt2_golden/adamw_step.safetensors),
every element within 1e-6 but one kind. The gradient of the tied head reaches the token embedding, as in PyTorch.

The exception: the key part of each block's `c_attn.bias` (elements n_embd .. 2 n_embd). Adding b_k to every key
adds q . b_k to a whole row of scores, which the softmax ignores, so its exact gradient is zero; both frameworks
compute float32 rounding noise there (about 1e-9), and Adam's first step turns any nonzero gradient into a move of
about lr whatever its size, so those elements are noise in both. They are checked to be noise (gradient below
1e-8) and to move at most lr + lr * weight decay, as any Adam step does."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.trainer.decoders.golden import FIXTURES, GOLDEN, INPUT_IDS

TOLERANCE = 1e-6
GOLDEN_WIDTH = json.loads((FIXTURES / "gpt2-tiny" / "config.json").read_text())["n_embd"]


@pytest.fixture(scope="module")
def stepped():
    """The decoder's weights after one AdamW step, the PyTorch weights after theirs, and the loss stepped from."""
    import tensorflow as tf
    from safetensors.numpy import load_file

    from trainer.adamw import AdamW
    from trainer.decoders.ops import causal_lm_loss
    from trainer.decoders.pretrained import load_pretrained

    settings = GOLDEN["adamw"]
    model = load_pretrained(FIXTURES / "gpt2-tiny")
    variables = list(model.weights.values())
    optimizer = AdamW(variables, settings["lr"], weight_decay=settings["weight_decay"],
                      beta_1=settings["betas"][0], beta_2=settings["betas"][1], epsilon=settings["eps"],
                      no_decay_names=settings["no_decay"])
    with tf.GradientTape() as tape:
        loss = causal_lm_loss(model, tf.constant(INPUT_IDS))
    gradients = tape.gradient(loss, variables)
    optimizer.apply_gradients(gradients)
    ours = {name: variable.numpy() for name, variable in model.weights.items()}
    key_bias_gradients = {name: gradient.numpy()[slice(GOLDEN_WIDTH, 2 * GOLDEN_WIDTH)]
                          for name, gradient in zip(model.weights, gradients, strict=True) if is_attention_bias(name)}
    return ours, load_file(str(FIXTURES / "adamw_step.safetensors")), float(loss), key_bias_gradients


def is_attention_bias(name: str) -> bool:
    return name.endswith("attn.c_attn.bias")


def without_key_bias(name: str, value: np.ndarray, width: int) -> np.ndarray:
    return np.concatenate([value[:width], value[2 * width:]]) if is_attention_bias(name) else value


def test_the_loss_stepped_from_is_pytorchs(stepped):
    _, _, loss, _ = stepped
    assert loss == pytest.approx(GOLDEN["loss"], rel=1e-6)


def test_weights_after_one_adamw_step_are_pytorchs_within_1e_6(stepped):
    ours, theirs, _, _ = stepped
    # PyTorch's named_parameters list the tied head once, as the embedding.
    assert set(ours) == set(theirs) and "lm_head.weight" not in theirs
    width = GOLDEN_WIDTH
    differences = {name: float(np.max(np.abs(without_key_bias(name, ours[name], width)
                                              - without_key_bias(name, theirs[name], width)))) for name in theirs}
    worst = max(differences, key=differences.get)
    print(f"largest |weight difference| after one AdamW step: {differences[worst]:.2e} ({worst})")
    assert differences[worst] <= TOLERANCE, worst


def test_the_key_biases_have_a_zero_gradient_and_move_by_at_most_one_adam_step(stepped):
    ours, theirs, _, key_bias_gradients = stepped
    settings = GOLDEN["adamw"]
    bound = settings["lr"] * (1 + settings["weight_decay"]) + TOLERANCE
    assert len(key_bias_gradients) == 2
    for name, gradient in key_bias_gradients.items():
        assert np.max(np.abs(gradient)) < 1e-8, name
        keys = slice(GOLDEN_WIDTH, 2 * GOLDEN_WIDTH)
        assert np.max(np.abs(ours[name][keys] - theirs[name][keys])) <= 2 * bound, name


def test_the_step_moved_every_weight_the_fixture_moved(stepped):
    """The comparison means something: every tensor changed by far more than the tolerance in both."""
    from safetensors.numpy import load_file

    ours, theirs, _, _ = stepped
    before = load_file(str(FIXTURES / "gpt2-tiny" / "model.safetensors"))
    for name, value in theirs.items():
        assert np.max(np.abs(value - before[name])) > 100 * TOLERANCE, name
        assert np.max(np.abs(ours[name] - before[name])) > 100 * TOLERANCE, name
