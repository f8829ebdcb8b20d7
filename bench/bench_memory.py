"""The memory forecast (trainer/memory_forecast.py) against the memory training measured on CPU: the tiny,
tiny-llama and GPT-2 124M shapes, each with and without recomputed blocks.

Each case runs in its own process: TensorFlow imported and warmed up on a two-token model step first (its runtime,
kernels and tracing machinery), then the RSS is read as the baseline; then the model, AdamW and the step
(trainer/step.py's pieces without a strategy: loss, gradients, clip, update) run STEPS times. Measured = peak RSS
minus that baseline: the weights, gradients, moments and activations the forecast counts, plus what it does not
(the step's traced graph, the input batch, the allocator's slack). Target: |forecast - measured| / measured <= 15%.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
TARGET = 0.15
# (preset, vocabulary, batch, block): batches at which the tensors, not the runtime, dominate.
SHAPES = (("tiny", 2048, 32, 256), ("tiny-llama", 2048, 32, 256), ("gpt2-124m", 50257, 2, 256))


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def _peak_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure_here(preset: str, vocab: int, batch: int, block: int, recompute: bool) -> dict:
    """One case in this process (see the module's docstring)."""
    import numpy as np
    import tensorflow as tf

    from bench.bench_model import plain_step
    from core.config import RunConfig
    from trainer.decoders.pretrained import build_preset
    from trainer.memory_forecast import run_forecast
    from trainer.model_shapes import shape_of
    from trainer.step import adapt_model

    cfg = RunConfig(model=preset, block_size=block, batch_size_per_worker=batch, recompute=recompute, num_workers=1)
    warm = build_preset("tiny", vocab_size=300, eos_token_id=0, block_size=8, seed=1)
    plain_step(warm, cfg)(tf.zeros([1, 8], tf.int32))
    del warm
    baseline = max(_rss_mb(), _peak_mb())
    model = build_preset(preset, vocab_size=vocab, eos_token_id=0, block_size=block, seed=1)
    adapt_model(cfg, model)
    step = plain_step(model, cfg)
    tokens = tf.constant(np.random.default_rng(0).integers(0, vocab, (batch, block)), tf.int32)
    for _ in range(STEPS):
        float(step(tokens))
    forecast = run_forecast(cfg, shape_of(model.config)).as_mib()
    measured = _peak_mb() - baseline
    return {"preset": preset, "vocab": vocab, "batch": batch, "block": block, "recompute": recompute,
            "forecast_mb": forecast, "measured_mb": round(measured, 1), "baseline_rss_mb": round(baseline, 1),
            "error": round((forecast["total"] - measured) / measured, 3)}


def measure(preset: str, vocab: int, batch: int, block: int, recompute: bool) -> dict:
    """One case in a fresh process, so that no case inherits another's peak."""
    code = (f"import json; from bench.bench_memory import measure_here; "
            f"print('RESULT' + json.dumps(measure_here({preset!r}, {vocab}, {batch}, {block}, {recompute})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False,
                          env={"TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin",
                               "PYTHONPATH": str(REPO)})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if done.returncode or not lines:
        raise RuntimeError(f"{preset} recompute={recompute} failed: {done.stderr[-2000:]}")
    return json.loads(lines[0][len("RESULT"):])


def row(cases: list[dict]) -> dict:
    first = cases[0]
    arms = "; ".join(f"{'recompute' if c['recompute'] else 'stored'} forecast {c['forecast_mb']['total']:,.0f} MiB "
                     f"(activations {c['forecast_mb']['activations']:,.0f}) vs measured {c['measured_mb']:,.0f} MiB "
                     f"({c['error']:+.0%})" for c in cases)
    return {"benchmark": f"memory: forecast vs measured peak, {first['preset']}, vocab {first['vocab']}, batch "
                         f"{first['batch']} x {first['block']}, fp32, CPU peak RSS over the runtime's",
            "measured": arms + ".", "target": f"forecast within {TARGET:.0%} of the measured peak"}


def run(out: Path) -> dict:
    del out  # the figures go to bench-results/memory.json through bench/__main__.py
    cases = {preset: [measure(preset, vocab, batch, block, recompute) for recompute in (False, True)]
             for preset, vocab, batch, block in SHAPES}
    return {"cases": cases, "rows": [row(found) for found in cases.values()]}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(run(REPO / "bench-results")["rows"], indent=2))
