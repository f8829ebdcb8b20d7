"""AdamW with linear warmup and cosine decay, and loss scaling for float16."""

from __future__ import annotations

from core.config import RunConfig

# Decay to a tenth of the peak, as in the GPT-2/3 recipes.
FINAL_LR_FRACTION = 0.1
# Clip the globally averaged gradient to this norm (GPT-2/3 recipes); done in the train step, after the
# all-reduce, so every worker/accumulation split clips the same gradient.
GRAD_CLIP_NORM = 1.0
# Biases and LayerNorm scales/offsets are not decayed (names as in TFGPT2: ln_1, ln_2, ln_f, .../bias).
NO_DECAY_NAMES = ["bias", "ln_"]


def learning_rate_schedule(cfg: RunConfig):
    """Linear warmup to `learning_rate` over `warmup_steps`, then cosine to 10% of it at `max_steps`.

    Warmup starts at lr / (warmup_steps + 1), not 0, so the first step already learns (as nanoGPT does).
    """
    import tf_keras

    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    if not cfg.warmup_steps:
        return tf_keras.optimizers.schedules.CosineDecay(cfg.learning_rate, decay_steps, alpha=FINAL_LR_FRACTION)
    return tf_keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=cfg.learning_rate / (cfg.warmup_steps + 1),
        decay_steps=decay_steps,
        alpha=FINAL_LR_FRACTION,
        warmup_target=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
    )


def make_optimizer(cfg: RunConfig, schedule):
    """AdamW (GPT-2 betas) following `schedule`; wrapped in a dynamic loss-scale optimizer for float16."""
    import tf_keras

    optimizer = tf_keras.optimizers.AdamW(
        learning_rate=schedule,
        weight_decay=cfg.weight_decay,
        beta_1=0.9,
        beta_2=0.95,
        epsilon=1e-8,
    )
    optimizer.exclude_from_weight_decay(var_names=NO_DECAY_NAMES)
    if cfg.mixed_precision == "fp16":
        return tf_keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


def set_precision_policy(cfg: RunConfig) -> str:
    """Set the Keras global dtype policy before the model is built; returns its name."""
    import tf_keras

    policy = {"no": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}[cfg.mixed_precision]
    tf_keras.mixed_precision.set_global_policy(policy)
    return policy
