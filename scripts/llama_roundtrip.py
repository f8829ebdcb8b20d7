"""By hand (issue 51): a Llama-architecture checkpoint fine-tuned through the DAG and read back by PyTorch.

Run with the scratch environment's Python (PyTorch + transformers 5; never a project dependency), from the
repository root:

    /path/to/scratch-venv/bin/python scripts/llama_roundtrip.py make DIR
        a tiny random LlamaForCausalLM (grouped-query attention, llama3 rotary, an untied head) saved with
        transformers 5's save_pretrained, and a tokenizer.json with <s> / </s> built offline with `tokenizers`
        (a byte-level BPE trained on data/sample/), saved beside it
    make demo DEMO_ARGS="--conf '{\"model\": \"DIR\", \"tokenizer\": \"DIR\", \"num_workers\": 2}'"
    /path/to/scratch-venv/bin/python scripts/llama_roundtrip.py compare PROMOTED_MODEL_DIR
        loads the promoted model/ with transformers 5 + PyTorch (AutoModelForCausalLM, AutoTokenizer) and with the
        project's decoder (.venv's Python, load_pretrained), and prints the largest logit difference on 3 x 64
        tokens of the corpus
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
SHAPE = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
DECODER_LOGITS = """
import sys, numpy as np
from trainer.decoders.pretrained import load_pretrained
model = load_pretrained(sys.argv[1])
np.save(sys.argv[3], model(np.load(sys.argv[2])).numpy())
"""


def make(directory: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(path) for path in sorted((REPO / "data" / "sample").glob("*.txt"))], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), bos_token_id=0, eos_token_id=1, **SHAPE)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    print(f"{directory}: LlamaForCausalLM, {sum(p.numel() for p in model.parameters())} "
          f"parameters, vocabulary {len(fast)}")


def compare(directory: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model, loading = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, output_loading_info=True)
    model.eval()
    text = (REPO / "data" / "sample" / "tempest_gut.txt").read_text()
    stream = tokenizer(text[20000:30000])["input_ids"]  # with the tokenizer's <s> first
    ids = np.asarray([stream[start:start + 64] for start in (0, 64, 128)], np.int32)
    with torch.no_grad():
        theirs = model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    with tempfile.TemporaryDirectory() as scratch:
        np.save(Path(scratch) / "ids.npy", ids)
        subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", DECODER_LOGITS, str(directory),
                        str(Path(scratch) / "ids.npy"), str(Path(scratch) / "ours.npy")], check=True, cwd=REPO)
        ours = np.load(Path(scratch) / "ours.npy")
    config = json.loads((directory / "config.json").read_text())
    print(json.dumps({
        "architectures": config["architectures"], "model": type(model).__name__, "tokens": list(ids.shape),
        "missing_keys": sorted(loading["missing_keys"]), "unexpected_keys": sorted(loading["unexpected_keys"]),
        "rope_parameters": config["rope_parameters"], "tie_word_embeddings": config["tie_word_embeddings"],
        "max_abs_logit_diff": float(np.max(np.abs(ours - theirs))), "max_abs_logit": float(np.max(np.abs(theirs))),
        "greedy_identical": bool(np.array_equal(ours.argmax(-1), theirs.argmax(-1))),
        "first_ids": ids[0, :6].tolist(), "bos_token_id": tokenizer.bos_token_id,
    }, indent=1))


if __name__ == "__main__":
    {"make": make, "compare": compare}[sys.argv[1]](Path(sys.argv[2]).resolve())
