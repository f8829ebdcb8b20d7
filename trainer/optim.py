"""The optimizer recipe's constants (GPT-2/3): trainer/adamw.py, recipe.py and train.py read them from here."""

from __future__ import annotations

# Decay to a tenth of the peak, as in the GPT-2/3 recipes.
FINAL_LR_FRACTION = 0.1
# Clip the globally averaged gradient to this norm (GPT-2/3 recipes); done in the train step, after the
# all-reduce, so every worker/accumulation split clips the same gradient.
GRAD_CLIP_NORM = 1.0
# Biases and norm scales/offsets are not decayed (patterns searched in the variables' Hugging Face names: GPT-2's
# ln_1, ln_2, ln_f, .../bias; Llama's and Qwen2's input_layernorm, post_attention_layernorm, model.norm).
NO_DECAY_NAMES = ["bias", "ln_", "norm"]
