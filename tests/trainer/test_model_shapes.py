"""trainer/model_shapes.py: the parameters the memory forecast counts from config.json's fields are those of the
tensors each architecture saves (its decoder config's `parameter_shapes`), biases and untied heads included."""

from __future__ import annotations

import math

import pytest

from trainer.decoders.architectures import parameter_shapes
from trainer.decoders.gpt2_config import GPT2Config
from trainer.decoders.llama_config import LlamaConfig
from trainer.model_shapes import shape_of

LLAMA_SHAPE = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
CONFIGS = {
    "gpt2": GPT2Config(n_layer=2, n_embd=32, n_head=4, n_inner=80, vocab_size=96, n_positions=64),
    "llama": LlamaConfig(**LLAMA_SHAPE),
    "llama, biased, untied": LlamaConfig(**LLAMA_SHAPE, attention_bias=True, mlp_bias=True,
                                         tie_word_embeddings=False),
    "qwen2": LlamaConfig(model_type="qwen2", **LLAMA_SHAPE, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_counted_parameters_are_the_saved_tensors(name):
    config = CONFIGS[name]
    saved = parameter_shapes(config)
    shape = shape_of(config)
    assert shape.matrix_parameters() == sum(math.prod(dims) for dims in saved.values() if len(dims) == 2)
    assert shape.vector_parameters() == sum(math.prod(dims) for dims in saved.values() if len(dims) == 1)
