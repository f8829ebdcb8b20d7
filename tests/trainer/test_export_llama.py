"""The numpy Llama / Qwen2 that reads the safetensors export back for parity computes what transformers 5 with
PyTorch computed on the golden fixtures (tests/trainer/decoders/fixtures/llama_golden)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.decoders.llama_golden import CASES, FIXTURES, INPUT_IDS, logits


@pytest.mark.parametrize("case", CASES)
def test_the_numpy_llama_reads_each_golden_checkpoint_as_pytorch(case):
    from trainer.export import safetensors_logits

    found = safetensors_logits(FIXTURES / case, INPUT_IDS)
    assert found.dtype == np.float32
    assert np.max(np.abs(found - logits(case))) <= 1e-5
