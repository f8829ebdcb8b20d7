"""Llama / Qwen2 config.json read and checked without TensorFlow: both generations' rotary keys, the weights'
names and shapes, and every value the decoder cannot build refused by name before anything is loaded."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.trainer.decoders.llama_golden import FIXTURES
from trainer.decoders.architectures import CheckpointError, check_block_size, config_from_json, parameter_shapes
from trainer.decoders.llama_config import LlamaConfig, inverse_frequencies

QWEN2 = json.loads((FIXTURES / "qwen2-bias-gqa" / "config.json").read_text())
LLAMA = json.loads((FIXTURES / "llama3-gqa-untied" / "config.json").read_text())


def test_both_architectures_and_a_config_without_architectures_are_read():
    assert config_from_json(LLAMA, "x").architecture == "LlamaForCausalLM"
    assert config_from_json(QWEN2, "x").architecture == "Qwen2ForCausalLM"
    without = {key: value for key, value in QWEN2.items() if key != "architectures"}
    assert config_from_json(without, "x").model_type == "qwen2"


@pytest.mark.parametrize(("config", "message"), [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
     "'MistralForCausalLM'.* are GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM"),
    ({"model_type": "gemma"}, "model_type 'gemma' .*not supported"),
    ({**LLAMA, "model_type": "qwen2"}, "architectures names LlamaForCausalLM but model_type is 'qwen2'"),
])
def test_other_architectures_are_refused_by_name(config, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_json(config, "x/config.json")


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_scaling type 'yarn' is not supported: .* default, linear, llama3"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "needs .* numbers for factor"),
    ({"num_key_value_heads": 3}, "'num_attention_heads' 4 is not a multiple of 'num_key_value_heads' 3"),
    ({"num_attention_heads": 5, "head_dim": None}, "'hidden_size' 32 is not divisible by 'num_attention_heads' 5"),
    ({"hidden_act": "gelu"}, "'hidden_act' 'gelu' is not supported"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers: expected int, got str"),
])
def test_a_value_the_decoder_cannot_build_is_refused_naming_the_key(change, message):
    with pytest.raises(CheckpointError, match=f"x/config.json: .*{message}"):
        config_from_json({**LLAMA, **change}, "x/config.json")


def test_a_sliding_window_shorter_than_the_block_is_refused_with_the_setting_to_change():
    sliding = config_from_json({**QWEN2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
                                "layer_types": None}, "x")
    assert sliding.sliding_layers == (1,) and sliding.n_positions == 16
    check_block_size(sliding, 16, "m")
    with pytest.raises(CheckpointError, match=r"block_size 32 is longer than the sliding window of model m "
                                              r"\(use_sliding_window, sliding_window 16, layers \[1\]\): lower "
                                              "'block_size' in the run config to 16"):
        check_block_size(sliding, 32, "m")
    with pytest.raises(CheckpointError, match="'sliding_window' is None"):
        config_from_json({**QWEN2, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": None},
                         "x")
    # Qwen2 checkpoints ship sliding_window with use_sliding_window off: full attention, nothing refused.
    check_block_size(config_from_json({**QWEN2, "sliding_window": 4, "layer_types": None}, "x"), 64, "m")


def test_weight_names_are_transformers_with_linear_weights_out_by_in():
    shapes = parameter_shapes(config_from_json(QWEN2, "x"))
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (32, 32)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 32)  # 2 key/value heads of 8
    assert shapes["model.layers.0.self_attn.k_proj.bias"] == (16,)
    assert shapes["model.layers.1.mlp.gate_proj.weight"] == (24, 32)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (32, 24)
    assert list(shapes)[-1] == "lm_head.weight" and "model.layers.0.self_attn.o_proj.bias" not in shapes


def test_inverse_frequencies_of_the_llama3_rescaling_keep_interpolate_and_divide():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, rope_parameters=LLAMA["rope_parameters"])
    plain = 1.0 / 100.0 ** (np.arange(0, 8, 2) / 8)
    found = inverse_frequencies(config)
    np.testing.assert_allclose(found[0], plain[0], rtol=1e-6)  # wavelength 6 < 32 / 4: kept
    assert plain[1] / 4 < found[1] < plain[1]  # wavelength 20: interpolated
    np.testing.assert_allclose(found[2:], plain[2:] / 4, rtol=1e-6)  # wavelengths 63, 199 > 32: divided


def test_the_config_module_imports_no_tensorflow():
    import subprocess
    import sys

    code = ("import sys; import trainer.decoders.architectures, trainer.decoders.llama_config; "
            "assert 'tensorflow' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_checkpoint_with_a_short_sliding_window_is_refused_before_any_weight_is_read(tmp_path):
    import shutil

    from trainer.decoders.pretrained import check_checkpoint

    directory = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "qwen2-bias-gqa", directory)
    sliding = {**QWEN2, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None}
    (directory / "config.json").write_text(json.dumps(sliding))
    (directory / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes()[:8])  # unread
    with pytest.raises(CheckpointError, match="block_size 32 is longer than the sliding window"):
        check_checkpoint(str(directory), block_size=32)
