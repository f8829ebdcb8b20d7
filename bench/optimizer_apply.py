"""One AdamW update of GPT-2 124M-sized float32 variables: trainer.adamw against tf_keras' AdamW, side by side.

    .venv/bin/python -m bench.optimizer_apply [--repeats N]

Both optimizers update the same 124,439,808 parameters (GPT-2 124M's tensors, named as Hugging Face names them)
with the same gradients, inside a `tf.function`, and inside one compiled with `jit_compile=True` (XLA); each
follows the run's schedule and decays all but biases and LayerNorms, as training does. The four variants run
interleaved, `--repeats` rounds after one untimed call each (tracing, compiling), so a shared machine's load
falls on all of them alike; the ratios are medians of each round's ratios. A one-off comparison for issue 50:
it needs tf-keras, which leaves the project after it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import tensorflow as tf

from trainer.adamw import AdamW
from trainer.optim import NO_DECAY_NAMES
from trainer.recipe import learning_rate_schedule

CONFIG = SimpleNamespace(learning_rate=3e-4, warmup_steps=20, max_steps=300, weight_decay=0.01)


def gpt2_124m_shapes(layers: int = 12, width: int = 768, vocab: int = 50257, positions: int = 1024) -> dict:
    shapes = {"transformer.wte.weight": (vocab, width), "transformer.wpe.weight": (positions, width)}
    for index in range(layers):
        block = f"transformer.h.{index}"
        for name, shape in (("ln_1.weight", (width,)), ("ln_1.bias", (width,)),
                            ("attn.c_attn.weight", (width, 3 * width)), ("attn.c_attn.bias", (3 * width,)),
                            ("attn.c_proj.weight", (width, width)), ("attn.c_proj.bias", (width,)),
                            ("ln_2.weight", (width,)), ("ln_2.bias", (width,)),
                            ("mlp.c_fc.weight", (width, 4 * width)), ("mlp.c_fc.bias", (4 * width,)),
                            ("mlp.c_proj.weight", (4 * width, width)), ("mlp.c_proj.bias", (width,))):
            shapes[f"{block}.{name}"] = shape
    return {**shapes, "transformer.ln_f.weight": (width,), "transformer.ln_f.bias": (width,)}


def ours(variables: list[tf.Variable]):
    optimizer = AdamW(variables, learning_rate_schedule(CONFIG), weight_decay=CONFIG.weight_decay)
    return optimizer.apply_gradients


def tf_keras_adamw(variables: list[tf.Variable]):
    """What trainer.optim.make_optimizer builds today, applied as train.py applies it."""
    import tf_keras

    from trainer.optim import learning_rate_schedule as keras_schedule

    optimizer = tf_keras.optimizers.AdamW(learning_rate=keras_schedule(CONFIG), weight_decay=CONFIG.weight_decay,
                                          beta_1=0.9, beta_2=0.95, epsilon=1e-8)
    optimizer.exclude_from_weight_decay(var_names=NO_DECAY_NAMES)
    optimizer.build(variables)
    return lambda gradients: optimizer.apply_gradients(zip(gradients, variables), skip_gradients_aggregation=True)


def timed(function, gradients) -> tuple[float, float]:
    """Wall and CPU seconds (all threads) of one call: on a shared machine CPU time is the steadier figure."""
    wall, cpu = time.perf_counter(), time.process_time()
    function(gradients).numpy()  # a tensor the update computes: reading it waits for the update
    return time.perf_counter() - wall, time.process_time() - cpu


def median_ratio(slower: list[float], faster: list[float]) -> float:
    return statistics.median(s / f for s, f in zip(slower, faster))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    shapes = gpt2_124m_shapes()
    variables = [tf.Variable(tf.random.stateless_normal(s, seed=[i, 0], stddev=0.02), name=n)
                 for i, (n, s) in enumerate(shapes.items())]
    gradients = [tf.random.stateless_normal(s, seed=[i, 1], stddev=1e-3) for i, s in enumerate(shapes.values())]
    print(f"{sum(v.shape.num_elements() for v in variables):,} parameters in {len(variables)} tensors")
    variants = {}
    for name, make in (("trainer.adamw", ours), ("tf_keras AdamW", tf_keras_adamw)):
        apply = make(variables)
        variants[f"{name}, tf.function"] = tf.function(apply)
        variants[f"{name}, tf.function(jit_compile=True)"] = tf.function(apply, jit_compile=True)
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for name, function in variants.items():
        print(f"  {name}: first call (trace/compile) {timed(function, gradients)[0]:.2f} s", flush=True)
    for _ in range(args.repeats):
        for name, function in variants.items():
            seconds, cpu_seconds = timed(function, gradients)
            wall[name].append(seconds)
            cpu[name].append(cpu_seconds)
    for name in variants:
        print(f"{name}: median {statistics.median(wall[name]):.3f} s (min {min(wall[name]):.3f}, max "
              f"{max(wall[name]):.3f}), CPU {statistics.median(cpu[name]):.3f} s")
    ours_plain, ours_xla, keras_plain, keras_xla = variants
    for mode, mine, theirs in (("tf.function", ours_plain, keras_plain), ("XLA", ours_xla, keras_xla),
                               ("ours with XLA vs tf_keras in a plain tf.function", ours_xla, keras_plain)):
        print(f"speed vs tf_keras, {mode}: {median_ratio(wall[theirs], wall[mine]):.2f}x by wall time, "
              f"{median_ratio(cpu[theirs], cpu[mine]):.2f}x by CPU time (median of {args.repeats} rounds)")

if __name__ == "__main__":
    main()
