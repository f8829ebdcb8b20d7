"""The Llama / Qwen2 golden fixtures (made by fixtures/make_llama_golden.py) and what transformers 5 with PyTorch
computed with them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llama_golden"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())
INPUT_IDS = np.asarray(GOLDEN["input_ids"], np.int32)
CASES = tuple(GOLDEN["cases"])


def logits(case: str) -> np.ndarray:
    """PyTorch's float32 logits of the case's checkpoint on INPUT_IDS."""
    with np.load(FIXTURES / "golden.npz") as loaded:
        return loaded[case]
