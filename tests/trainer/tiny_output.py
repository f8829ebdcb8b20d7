"""A training output made without trainer/train.py: the `tiny` preset trained a few AdamW steps on a dataset's
first training sequences in this process, then written by `trainer.outputs.export_model`, the function the chief
calls (model/ and, with `export_formats`, exports/)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.config import RunConfig


def trained_decoder(manifest_url: str, *, steps: int = 8, learning_rate: float = 3e-3, batch: int = 8):
    """The tiny preset after `steps` AdamW steps on the first training sequences (the same batch order each
    time)."""
    import tensorflow as tf

    from trainer.adamw import AdamW
    from trainer.data import load_manifest
    from trainer.decoders.ops import causal_lm_loss
    from trainer.decoders.pretrained import build_preset
    from trainer.eval_sample import leading_records

    manifest = load_manifest(manifest_url)
    block = manifest["block_size"]
    records, _ = leading_records(manifest_url, manifest, "train", steps * batch * block)
    sequences = np.concatenate(records).reshape(-1, block).astype(np.int32)
    model = build_preset("tiny", vocab_size=manifest["tokenizer"]["vocab_size"],
                         eos_token_id=manifest["tokenizer"]["eos_token_id"], block_size=block, seed=0)
    variables = list(model.weights.values())
    optimizer = AdamW(variables, learning_rate, weight_decay=0.1)
    for step in range(steps):
        tokens = tf.constant(np.take(sequences, range(step * batch, (step + 1) * batch), axis=0, mode="wrap"))
        with tf.GradientTape() as tape:
            loss = causal_lm_loss(model, tokens)
        optimizer.apply_gradients(tape.gradient(loss, variables))
    return model


def write_output(model, manifest_url: str, output: str, work_dir: Path, **settings) -> None:
    """`output` as the chief of a one-worker run leaves it: model/ (and exports/ unless export_formats is [])."""
    from trainer.job import plan_job_for
    from trainer.outputs import export_model

    cfg = RunConfig.from_params({"num_workers": 1, "model": "tiny", "tokenizer": "bpe:320", "block_size": 32,
                                 **settings})
    job = plan_job_for(cfg, "config.json", manifest_url, output, environ={})
    export_model(job, model, work_dir)
