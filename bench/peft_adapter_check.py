"""By hand: `peft` loads a LoRA adapter this project wrote onto its base in transformers 5 + PyTorch and gives the
merged model's logits. Two steps, in two environments (PyTorch and peft are never project dependencies):

    .venv/bin/python -m bench.peft_adapter_check make DIR [--shape tiny|gpt2-124m|tiny-llama|CHECKPOINT_DIR]
    /work/scratch-venv/bin/python bench/peft_adapter_check.py check DIR   # torch + transformers 5 + peft

`make` builds the preset's decoder (its architecture's init) or loads a checkpoint directory (a Llama or Qwen2
one that scripts/llama_roundtrip.py makes with transformers 5, say), saves it as the base (save_pretrained), gives
it LoRA adapters on every projection of its architecture with random B matrices (trained adapters are as good as
any other values here), writes the adapter (trainer/adapter_export.py) and the merged model, and the decoder's own
logits on fixed tokens. `check`
loads the base with AutoModelForCausalLM, the adapter with PeftModel.from_pretrained, and prints the largest logit
differences against the decoder, the merged checkpoint loaded by transformers, and PEFT's merge_and_unload.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOKENS_FILE, LOGITS_FILE = "tokens.npy", "decoder_logits.npy"
VOCAB = 512


def make(directory: Path, shape: str) -> None:
    import numpy as np
    import tensorflow as tf

    from core.config import RunConfig
    from trainer.adapter_export import write_adapter
    from trainer.decoders.pretrained import build_preset, load_pretrained, save_pretrained
    from trainer.lora import attach_lora, merged_decoder
    from trainer.lora_plan import plan_for_decoder

    cfg = RunConfig(model=shape, adapter="lora", lora_rank=8, lora_alpha=16, seed=5)
    if Path(shape).is_dir():
        model = load_pretrained(shape)
    else:
        model = build_preset(shape, vocab_size=VOCAB, eos_token_id=0, block_size=64, seed=cfg.seed)
    save_pretrained(model, str(directory / "base"))
    adapters = attach_lora(model, plan_for_decoder(cfg, model.config), seed=cfg.seed)
    for variable in adapters.tensors.values():
        if ".lora_B." in variable.name:
            variable.assign(tf.random.normal(variable.shape, stddev=0.02, seed=11))
    write_adapter(cfg, adapters, str(directory / "adapter"))
    merged = merged_decoder(model)
    save_pretrained(merged, str(directory / "merged"))
    vocab = model.config.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (3, 32)).astype(np.int64)
    np.save(directory / TOKENS_FILE, tokens)
    logits = model(tf.constant(tokens, tf.int32)).numpy()
    np.save(directory / LOGITS_FILE, logits)
    unmerged_vs_merged = float(np.abs(merged(tf.constant(tokens, tf.int32)).numpy() - logits).max())
    print(json.dumps({"shape": shape, "decoder_merged_vs_unmerged": unmerged_vs_merged}))


def check(directory: Path) -> None:
    import numpy as np
    import peft
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tokens = torch.from_numpy(np.load(directory / TOKENS_FILE))
    decoder = np.load(directory / LOGITS_FILE)
    base = AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(tokens).logits.numpy()  # before PEFT injects its layers into `base`
    adapted = peft.PeftModel.from_pretrained(base, directory / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(directory / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        peft_logits = adapted(tokens).logits.numpy()
        merged_logits = merged(tokens).logits.numpy()
        unloaded = adapted.merge_and_unload()(tokens).logits.numpy()
    print(json.dumps({
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "max_abs_logit": float(np.abs(decoder).max()),
        "peft_vs_base (the adapter's effect)": float(np.abs(peft_logits - base_logits).max()),
        "peft_vs_decoder": float(np.abs(peft_logits - decoder).max()),
        "peft_vs_merged_checkpoint": float(np.abs(peft_logits - merged_logits).max()),
        "peft_merge_and_unload_vs_merged_checkpoint": float(np.abs(unloaded - merged_logits).max()),
        "greedy_identical": bool((peft_logits.argmax(-1) == merged_logits.argmax(-1)).all()),
    }, indent=2))


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    if command == "make":
        folder.mkdir(parents=True, exist_ok=True)
        make(folder, sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--shape" else "tiny")
    else:
        check(folder)
