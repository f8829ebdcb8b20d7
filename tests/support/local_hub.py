"""A local hub in huggingface_hub's cache layout, holding a tiny TF GPT-2 made here (no network, no download):

    <hub>/models--<org>--<name>/snapshots/<sha>/   config.json, tf_model.h5, generation_config.json, tokenizer
    <hub>/models--<org>--<name>/refs/<revision>    the commit sha a branch or tag names (refs/main: the head)

With HF_HUB_OFFLINE=1 (tests/conftest.py) huggingface_hub resolves names and revisions from it alone, as it does
from `HF_HOME/hub`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TINY = {"n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 64}
VOCAB = 300


def add_model(hub: Path, name: str, *, revisions: tuple[str, ...] = ("main",), seed: int = 0,
              model_type: str = "gpt2", tf_weights: bool = True) -> str:
    """A tiny GPT-2 (random init from `seed`) as one commit of `name`, named by `revisions`; returns its sha."""
    import tf_keras
    from transformers import GPT2Config, TFGPT2LMHeadModel

    sha = hashlib.sha1(f"{name}@{seed}".encode()).hexdigest()
    repo = hub / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True, exist_ok=True)
    tf_keras.utils.set_random_seed(seed)
    model = TFGPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **TINY))
    model.build_in_name_scope()
    model.save_pretrained(str(snapshot))
    if not tf_weights:
        (snapshot / "tf_model.h5").unlink()
    if model_type != "gpt2":
        config = json.loads((snapshot / "config.json").read_text())
        (snapshot / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    (snapshot / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (snapshot / "pytorch_model.bin").write_bytes(b"not fetched")  # other frameworks' weights stay on the hub
    (repo / "refs").mkdir(exist_ok=True)
    for revision in revisions:
        (repo / "refs" / revision).write_text(sha)
    return sha
