"""One training step (forward, backward, clip, AdamW update) of the project's model against the alternatives.

Arms, at the same batch (4 x 128 tokens), fp32, one process each on this machine's CPUs:
- `decoder`: trainer.decoders' GPT2Decoder with trainer.adamw's AdamW, schedule and clip, in a `tf.function`;
- `decoder XLA`: the same step in one `tf.function(jit_compile=True)`;
- `PyTorch eager`: transformers 5's GPT2LMHeadModel with torch.optim.AdamW in the scratch venv
  (bench/model_torch_step.py as a subprocess; never a project dependency; the arm is left out when it is absent).
For the tiny preset and the GPT-2 124M shape. The arms run interleaved, round after round, after an untimed
warm-up (tracing, compiling), so a shared machine's load falls on all alike; each figure is a median over rounds,
each ratio the median of the rounds' ratios, by wall time and by CPU time (all threads of the arm's process), the
steadier figure when other jobs share the cores.

The path the trainer ran before issue 50 (transformers 4.57's TF GPT-2 with tf-keras' AdamW in a `tf.function`)
was measured as a fifth arm in the same rounds before it was removed (commit e0e993e, 2026-12-07); BEFORE keeps
those figures, and every row repeats them beside the new ones, named as measured then.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_PYTHON = Path(os.environ.get("BENCH_TORCH_PYTHON", "/work/scratch-venv/bin/python"))
BATCH, BLOCK = 4, 128
# shape name -> (vocabulary, timed rounds, steps per timed sample): the tiny model's step is short, so a sample
# is several steps.
SHAPES = {"tiny": (2048, 5, 10), "gpt2-124m": (50257, 5, 1)}
NEW, NEW_XLA, TORCH = "decoder", "decoder XLA", "PyTorch eager"
# The old path's medians (seconds per step) and the decoder's paired speed-ups over it, from the run that measured
# them side by side (bench-results/history/20261207T042627Z-model.json: 5 rounds, load average 7-12 on 2 cores).
BEFORE = {"tiny": {"wall_s": 0.053, "cpu_s": 0.0430, "decoder": 0.96, "decoder XLA": 1.58},
          "gpt2-124m": {"wall_s": 16.2, "cpu_s": 5.63, "decoder": 1.00, "decoder XLA": 1.13}}
BEFORE_LABEL = "before (transformers 4.57 TF GPT-2 + tf-keras AdamW, 2026-12-07, same run as the decoder's ratios)"


def _tokens(vocab: int):
    import numpy as np
    import tensorflow as tf

    return tf.constant(np.random.default_rng(0).integers(0, vocab, (BATCH, BLOCK)), tf.int32)


def _timed(step, tokens, count: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(count):
        loss = step(tokens)
    value = float(loss)  # waits for the last step
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "loss": value}


def _schedule_config():
    from types import SimpleNamespace

    return SimpleNamespace(learning_rate=3e-4, warmup_steps=20, max_steps=300, weight_decay=0.1)


def plain_step(model, cfg, *, xla: bool = False):
    """The step a user would write for `model` (no strategy, no metrics): loss, gradients, trainer.recipe's clip and
    trainer.adamw's AdamW on `cfg`'s schedule, in one `tf.function`; it returns the loss."""
    import tensorflow as tf

    from trainer.adamw import AdamW
    from trainer.decoders.ops import causal_lm_loss
    from trainer.recipe import clip_gradients, learning_rate_schedule

    variables = list(model.trainable_variables)
    optimizer = AdamW(variables, learning_rate_schedule(cfg), weight_decay=cfg.weight_decay)

    @tf.function(jit_compile=xla)
    def step(tokens):
        with tf.GradientTape() as tape:
            loss = causal_lm_loss(model, tokens)
        gradients, _ = clip_gradients(tape.gradient(loss, variables))
        optimizer.apply_gradients(gradients)
        return loss

    return step


def new_step(preset: str, vocab: int, *, xla: bool):
    """trainer.train's step with the project's decoder: trainer.adamw, trainer.recipe's schedule and clip."""
    from trainer.decoders.pretrained import build_preset

    model = build_preset(preset, vocab_size=vocab, eos_token_id=vocab - 1, block_size=BLOCK)
    return plain_step(model, _schedule_config(), xla=xla)


class TorchArm:
    """The scratch venv's PyTorch steps, one subprocess answering `<steps>` lines (bench/model_torch_step.py)."""

    def __init__(self, shape: dict, vocab: int) -> None:
        spec = {**shape, "vocab_size": vocab, "batch": BATCH, "block": BLOCK}
        self.process = subprocess.Popen([str(TORCH_PYTHON), str(REPO / "bench" / "model_torch_step.py"),
                                         json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self.process.stdout.readline())

    def run(self, count: int) -> dict:
        self.process.stdin.write(f"{count}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _arms(preset: str, vocab: int) -> dict:
    from core.config import MODEL_PRESETS

    shape = MODEL_PRESETS[preset]
    tokens = _tokens(vocab)
    arms = {}
    for name, xla in ((NEW, False), (NEW_XLA, True)):
        arms[name] = partial(_timed, new_step(preset, vocab, xla=xla), tokens)
    if TORCH_PYTHON.exists():
        arms[TORCH] = TorchArm(shape, vocab)
    return arms


def measure(preset: str) -> dict:
    """Every arm's samples for one shape: {arm: {"wall_s": [...], "cpu_s": [...], "loss": last, "first_s": ...}}."""
    vocab, rounds, per_sample = SHAPES[preset]
    arms = _arms(preset, vocab)
    samples = {name: {"wall_s": [], "cpu_s": []} for name in arms}
    try:
        for name, arm in arms.items():
            first = arm.run(1) if isinstance(arm, TorchArm) else arm(1)
            samples[name]["first_s"] = round(first["wall_s"], 2)
            print(f"  {preset} {name}: first step (tracing/compiling) {first['wall_s']:.1f} s", flush=True)
        for _ in range(rounds):
            for name, arm in arms.items():
                figures = arm.run(per_sample) if isinstance(arm, TorchArm) else arm(per_sample)
                samples[name]["wall_s"].append(figures["wall_s"] / per_sample)
                samples[name]["cpu_s"].append(figures["cpu_s"] / per_sample)
                samples[name]["loss"] = round(figures["loss"], 4)
    finally:
        for arm in arms.values():
            if isinstance(arm, TorchArm):
                arm.close()
    return samples


def speedup(samples: dict, slower: str, faster: str, kind: str) -> float | None:
    if slower not in samples or faster not in samples:
        return None
    return statistics.median(s / f for s, f in zip(samples[slower][kind], samples[faster][kind]))


def summarize(preset: str, samples: dict) -> dict:
    medians = {name: {kind: round(statistics.median(s[kind]), 4) for kind in ("wall_s", "cpu_s")}
               for name, s in samples.items()}
    ratios = {}
    for label, slower, faster in ((f"{NEW} vs {TORCH}", TORCH, NEW), (f"{NEW_XLA} vs {TORCH}", TORCH, NEW_XLA)):
        wall, cpu = speedup(samples, slower, faster, "wall_s"), speedup(samples, slower, faster, "cpu_s")
        if wall is not None:
            ratios[label] = {"wall": round(wall, 2), "cpu": round(cpu, 2)}
    for name, figures in medians.items():
        print(f"{preset} {name}: {figures['wall_s']:.3f} s/step wall, {figures['cpu_s']:.3f} s CPU "
              f"(loss {samples[name]['loss']})")
    for label, ratio in ratios.items():
        print(f"{preset} speed, {label}: {ratio['wall']:.2f}x by wall time, {ratio['cpu']:.2f}x by CPU time")
    return {"medians": medians, "ratios": ratios, "samples": samples}


def row(preset: str, summary: dict) -> dict:
    medians, ratios = summary["medians"], summary["ratios"]
    tokens = BATCH * BLOCK
    arms = "; ".join(f"{name} {m['wall_s']:.3g} s ({tokens / m['wall_s']:.0f} tokens/s, CPU {m['cpu_s']:.3g} s)"
                     for name, m in medians.items())
    speeds = "; ".join(f"{label} {r['wall']:.2f}x wall / {r['cpu']:.2f}x CPU" for label, r in ratios.items())
    before = BEFORE[preset]
    return {"benchmark": f"model: one training step, {preset}, batch {BATCH} x {BLOCK}, fp32, CPU",
            "measured": f"{arms}. Speed: {speeds}. {BEFORE_LABEL}: {before['wall_s']:.3g} s (CPU {before['cpu_s']:.3g} "
                        f"s); by CPU time {NEW} {before[NEW]:.2f}x it, {NEW_XLA} {before[NEW_XLA]:.2f}x it",
            "target": f">= 1.0x before; the default (plain tf.function) >= 1.0x {TORCH}"}


def run(out: Path) -> dict:
    del out  # the figures go to bench-results/model.json through bench/__main__.py
    summaries = {preset: summarize(preset, measure(preset)) for preset in SHAPES}
    return {"summaries": summaries, "rows": [row(preset, summaries[preset]) for preset in SHAPES]}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(run(REPO / "bench-results")["rows"], indent=2))
