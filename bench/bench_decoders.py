"""One training step of each decoder architecture at a ~100M-parameter shape, against a GPT-2 of the same count.

Arms, at the same batch (4 x 128 tokens), fp32, one process on this machine's CPUs, each step (forward, backward,
clip, AdamW) compiled with XLA (`tf.function(jit_compile=True)`, bench_model.plain_step):
- `gpt2`: GPT2Decoder, 12 blocks of width 768, its MLP 2560 wide so its parameter count is the Llama's;
- `llama`: LlamaDecoder as LlamaForCausalLM, 12 blocks of width 768, 12 query heads and 4 key/value heads
  (grouped-query), SwiGLU 2048 wide, a tied head;
- `qwen2`: the same shape as Qwen2ForCausalLM (q/k/v biases).
All with a 32,000-token vocabulary. The arms run interleaved, round after round, after an untimed warm-up
(tracing, compiling); each ratio is the median of the rounds' ratios, by wall time and by CPU time.
"""

from __future__ import annotations

import json
import statistics
import sys
from functools import partial
from pathlib import Path

from bench.bench_model import BATCH, BLOCK, _schedule_config, _timed, _tokens, plain_step, speedup

REPO = Path(__file__).resolve().parents[1]
VOCAB, ROUNDS = 32000, 3
WIDTH, LAYERS, HEADS = 768, 12, 12
GPT2 = {"n_embd": WIDTH, "n_layer": LAYERS, "n_head": HEADS, "n_inner": 2560, "n_positions": 1024}
LLAMA = {"hidden_size": WIDTH, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": 4,
         "intermediate_size": 2048, "max_position_embeddings": 1024, "tie_word_embeddings": True}
ARCHITECTURES = ("gpt2", "llama", "qwen2")


def build(architecture: str):
    from trainer.decoders.gpt2_config import GPT2Config
    from trainer.decoders.llama_config import LlamaConfig
    from trainer.decoders.pretrained import build_decoder

    if architecture == "gpt2":
        return build_decoder(GPT2Config(vocab_size=VOCAB, **GPT2))
    return build_decoder(LlamaConfig(model_type=architecture, vocab_size=VOCAB, **LLAMA))


def measure() -> dict:
    from trainer.decoders.ops import count_parameters

    tokens = _tokens(VOCAB)
    arms, samples = {}, {}
    for architecture in ARCHITECTURES:
        model = build(architecture)
        arms[architecture] = partial(_timed, plain_step(model, _schedule_config(), xla=True), tokens)
        first = arms[architecture](1)
        samples[architecture] = {"wall_s": [], "cpu_s": [], "parameters": count_parameters(model),
                                 "first_s": round(first["wall_s"], 1)}
        print(f"  {architecture}: {count_parameters(model):,} parameters, first step (compiling) "
              f"{first['wall_s']:.1f} s", flush=True)
    for _ in range(ROUNDS):
        for architecture, arm in arms.items():
            figures = arm(1)
            samples[architecture]["wall_s"].append(figures["wall_s"])
            samples[architecture]["cpu_s"].append(figures["cpu_s"])
            samples[architecture]["loss"] = round(figures["loss"], 4)
    return samples


def rows(samples: dict) -> list[dict]:
    found = []
    for architecture in ARCHITECTURES[1:]:
        arm = samples[architecture]
        wall, cpu = (speedup(samples, architecture, "gpt2", kind) for kind in ("wall_s", "cpu_s"))
        medians = {name: (statistics.median(samples[name]["wall_s"]), statistics.median(samples[name]["cpu_s"]))
                   for name in ("gpt2", architecture)}
        line = "; ".join(f"{name} {samples[name]['parameters'] / 1e6:.1f}M parameters {wall_s:.2f} s/step "
                         f"(CPU {cpu_s:.2f} s)" for name, (wall_s, cpu_s) in medians.items())
        print(f"{architecture} vs gpt2: {line}; gpt2 / {architecture} step time {wall:.2f}x wall, {cpu:.2f}x CPU")
        found.append({
            "benchmark": f"decoders: one XLA training step, {architecture} vs GPT-2 of the same parameter count "
                         f"(~{arm['parameters'] / 1e6:.0f}M), batch {BATCH} x {BLOCK}, fp32, CPU",
            "measured": f"{line}. GPT-2's step time / {architecture}'s: {wall:.2f}x wall, {cpu:.2f}x CPU "
                        f"(median of {ROUNDS} interleaved rounds)",
            "target": ">= 0.8x (rotary, GQA and SwiGLU cost at most a fifth more than GPT-2's block)"})
    return found


def run(out: Path) -> dict:
    del out  # the figures go to bench-results/decoders.json through bench/__main__.py
    samples = measure()
    return {"samples": samples, "rows": rows(samples)}


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(run(REPO / "bench-results")["rows"], indent=2))
