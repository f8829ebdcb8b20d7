"""A local hub in huggingface_hub's cache layout, holding a tiny GPT-2 checkpoint made here (no network, no download):

    <hub>/models--<org>--<name>/snapshots/<sha>/   config.json, model.safetensors, generation_config.json, tokenizer
                                                   (and weights of other frameworks, which are never fetched)
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
              architecture: str = "GPT2LMHeadModel", safetensors: bool = True) -> str:
    """A tiny GPT-2 (random init from `seed`) as one commit of `name`, named by `revisions`; returns its sha.
    `architecture` rewrites its config.json's; `safetensors=False` leaves TF and PyTorch pickles alone."""
    from trainer.decoders.gpt2_config import GPT2Config
    from trainer.decoders.pretrained import build_decoder, save_pretrained

    sha = hashlib.sha1(f"{name}@{seed}".encode()).hexdigest()
    repo = hub / f"models--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True, exist_ok=True)
    model = build_decoder(GPT2Config(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, **TINY), seed=seed)
    save_pretrained(model, str(snapshot))
    if not safetensors:
        (snapshot / "model.safetensors").unlink()
    if architecture != "GPT2LMHeadModel":
        config = json.loads((snapshot / "config.json").read_text())
        (snapshot / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    (snapshot / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    for other in ("pytorch_model.bin", "tf_model.h5"):  # other frameworks' weights stay on the hub
        (snapshot / other).write_bytes(b"not fetched")
    (repo / "refs").mkdir(exist_ok=True)
    for revision in revisions:
        (repo / "refs" / revision).write_text(sha)
    return sha
