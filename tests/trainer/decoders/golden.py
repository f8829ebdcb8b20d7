"""The GPT-2 golden fixtures (made by fixtures/make_gpt2_golden.py) and what the reference implementations
computed with them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpt2_golden"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())
INPUT_IDS = np.asarray(GOLDEN["input_ids"], np.int32)


def arrays() -> dict[str, np.ndarray]:
    """PyTorch's logits of the float32 checkpoint and of its bfloat16 copy, and TFGPT2LMHeadModel's (4.57)."""
    with np.load(FIXTURES / "golden.npz") as loaded:
        found = dict(loaded)
    return {**found, "tf_gpt2_logits": np.load(FIXTURES / "tf_gpt2_logits.npy")}
