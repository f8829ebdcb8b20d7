"""One training step of the Llama / Qwen2 decoder against PyTorch's: each golden checkpoint loaded with
load_pretrained, the loss of the fixture's ids differentiated by the decoder and applied by trainer/adamw.py gives
the weights torch.optim.AdamW gave transformers 5's model (fixtures/llama_golden/adamw_<case>.safetensors), every
element within 1e-6 plus what Adam's first step makes of float32 rounding in its gradient.

Adam's first step moves an element by lr * g / (|g| + eps), whose slope lr * eps / (|g| + eps)^2 is large where the
gradient is tiny: the k_proj biases along a head's slowest rotary frequencies, which barely rotate, so a key bias
there adds nearly the same amount to a whole row of scores (GPT-2's key bias, where it is exactly zero), and an
embedding row whose terms nearly cancel. Two frameworks summing the same float32 terms in another order differ by
up to about GRADIENT_NOISE there; each element's tolerance adds that slope times GRADIENT_NOISE, which is below
1e-8 wherever |g| > 1e-5, and a handful of elements at most may use it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.decoders.llama_golden import CASES, FIXTURES, GOLDEN, INPUT_IDS

TOLERANCE = 1e-6
GRADIENT_NOISE = 1e-7  # float32 rounding of a gradient summed from many terms that nearly cancel


@pytest.mark.parametrize("case", CASES)
def test_weights_after_one_adamw_step_are_pytorchs_within_1e_6(case):
    import tensorflow as tf
    from safetensors.numpy import load_file

    from trainer.adamw import AdamW
    from trainer.decoders.ops import causal_lm_loss
    from trainer.decoders.pretrained import load_pretrained

    settings = GOLDEN["adamw"]
    model = load_pretrained(FIXTURES / case)
    variables = list(model.weights.values())
    optimizer = AdamW(variables, settings["lr"], weight_decay=settings["weight_decay"],
                      beta_1=settings["betas"][0], beta_2=settings["betas"][1], epsilon=settings["eps"])
    with tf.GradientTape() as tape:
        loss = causal_lm_loss(model, tf.constant(INPUT_IDS))
    gradients = tape.gradient(loss, variables)
    optimizer.apply_gradients(gradients)
    lr, eps = settings["lr"], settings["eps"]
    slope = {name: lr * eps / (np.abs(tf.convert_to_tensor(gradient).numpy()) + eps) ** 2
             for name, gradient in zip(model.weights, gradients, strict=True)}
    assert float(loss) == pytest.approx(GOLDEN["cases"][case]["loss"], rel=1e-6)
    theirs = load_file(str(FIXTURES / f"adamw_{case}.safetensors"))
    ours = {name: variable.numpy() for name, variable in model.weights.items()}
    assert set(ours) == set(theirs)  # a tied head is listed once, as the embedding
    differences = {name: np.abs(ours[name] - theirs[name]) for name in theirs}
    worst = max(differences, key=lambda name: differences[name].max())
    print(f"{case}: largest |weight difference| after one AdamW step: {differences[worst].max():.2e} ({worst})")
    for name, difference in differences.items():
        assert np.all(difference <= TOLERANCE + slope[name] * GRADIENT_NOISE), name
    assert sum(int(np.sum(difference > TOLERANCE)) for difference in differences.values()) <= 8
