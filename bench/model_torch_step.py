"""PyTorch + transformers 5 training steps for bench_model, run by the scratch venv's Python (never the project's).

    /work/scratch-venv/bin/python bench/model_torch_step.py '{"n_layer": 2, ..., "batch": 4, "block": 128}'

Builds GPT2LMHeadModel (dropout off) and torch.optim.AdamW as a PyTorch user would (eager, fp32, the GPT-2
recipe's betas, decay except biases and LayerNorms, global-norm clip 1.0), then answers each line `<n>` on stdin
with one JSON line: the wall and CPU seconds (this process, all threads) of `n` steps and the last loss. Standalone:
it imports nothing of the project, so the scratch venv needs only torch and transformers.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    shape = json.loads(sys.argv[1])
    torch.manual_seed(0)
    config = GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                        n_positions=shape["n_positions"], vocab_size=shape["vocab_size"],
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).train()
    decay = [p for n, p in model.named_parameters() if not ("bias" in n or "ln_" in n)]
    no_decay = [p for n, p in model.named_parameters() if "bias" in n or "ln_" in n]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (shape["batch"], shape["block"]), generator=generator)
    print(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(int(line)):
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu, "loss": value}),
              flush=True)


if __name__ == "__main__":
    main()
