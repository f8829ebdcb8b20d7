"""GPT-2's config.json read and written without transformers, and the supported architectures; no TensorFlow."""

from __future__ import annotations

import json

import pytest

from core.config import MODEL_PRESETS
from tests.trainer.decoders.golden import FIXTURES
from trainer.decoders.architectures import SUPPORTED, CheckpointError, check_block_size, config_from_json
from trainer.decoders.gpt2_config import GPT2Config, checkpoint_name, parameter_shapes, preset_config

WRITTEN_BY_TRANSFORMERS = json.loads((FIXTURES / "gpt2-tiny" / "config.json").read_text())


def test_a_config_json_written_by_transformers_5_is_read_and_written_back_with_its_keys_and_values():
    config = config_from_json(WRITTEN_BY_TRANSFORMERS, "gpt2-tiny/config.json")
    assert (config.vocab_size, config.n_positions, config.n_embd, config.n_layer, config.n_head) == (100, 32, 16, 2, 4)
    assert (config.inner, config.head_dim, config.layer_norm_epsilon) == (64, 4, 1e-5)
    expected = {key: value for key, value in WRITTEN_BY_TRANSFORMERS.items() if key != "transformers_version"}
    assert config.to_json() == expected


def test_generation_config_has_the_keys_transformers_5_derives():
    written = json.loads((FIXTURES / "gpt2-tiny" / "generation_config.json").read_text())
    config = config_from_json(WRITTEN_BY_TRANSFORMERS, "config.json")
    assert config.generation_config() == {key: value for key, value in written.items()
                                          if key != "transformers_version"}


def test_keys_a_base_model_carries_are_kept_and_missing_ones_take_transformers_defaults():
    # openai-community/gpt2's config.json: n_ctx and task_specific_params are not GPT2Config fields any more.
    value = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_ctx": 1024, "vocab_size": 50257,
             "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
             "resid_pdrop": 0.1}
    config = config_from_json(value, "config.json")
    assert (config.n_embd, config.n_layer, config.n_positions, config.eos_token_id) == (768, 12, 1024, 50256)
    written = config.to_json()
    assert written["n_ctx"] == 1024 and written["task_specific_params"] == value["task_specific_params"]
    assert written["resid_pdrop"] == 0.0  # the decoder trains without dropout: the config says so


@pytest.mark.parametrize(("value", "named"), [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "MistralForCausalLM"),
    ({"architectures": ["GPT2Model"], "model_type": "gpt2"}, "GPT2Model"),
    ({"model_type": "gpt_neox"}, "gpt_neox"),
    ({"architectures": "GPT2LMHeadModel"}, "GPT2LMHeadModel"),
])
def test_another_architecture_is_refused_by_name_with_the_supported_list(value, named):
    with pytest.raises(CheckpointError, match=f"{named}.*supported architectures are GPT2LMHeadModel"):
        config_from_json(value, "x/config.json")
    assert SUPPORTED == ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM")


@pytest.mark.parametrize(("change", "message"), [
    ({"n_head": 5}, "'n_embd' 16 is not divisible by 'n_head' 5"),
    ({"activation_function": "relu"}, "'activation_function' 'relu' is not supported"),
    ({"tie_word_embeddings": False}, "'tie_word_embeddings' is false"),
    ({"add_cross_attention": True}, "cross-attention"),
    ({"n_layer": 0}, "'n_layer' is 0"),
    ({"n_embd": "16"}, "n_embd: expected int, got str"),
    ({"layer_norm_epsilon": True}, "layer_norm_epsilon: expected float, got bool"),
])
def test_a_value_the_decoder_cannot_build_is_refused_naming_the_file_and_key(change, message):
    with pytest.raises(CheckpointError, match=f"x/config.json: .*{message}"):
        config_from_json({**WRITTEN_BY_TRANSFORMERS, **change}, "x/config.json")


def test_every_gpt2_preset_has_a_config_with_the_tokenizer_vocabulary():
    for preset, shape in MODEL_PRESETS.items():
        if "model_type" in shape:  # another architecture's (test_llama.py)
            continue
        config = preset_config(preset, vocab_size=321, eos_token_id=7)
        assert {key: getattr(config, key) for key in shape} == shape
        assert (config.vocab_size, config.bos_token_id, config.eos_token_id) == (321, 7, 7)
    with pytest.raises(ValueError, match="no model preset 'huge': the presets are tiny, gpt2-124m, tiny-llama"):
        preset_config("huge", vocab_size=1, eos_token_id=0)


def test_block_size_beyond_the_positions_is_refused_with_the_setting_to_change():
    config = GPT2Config(n_positions=64)
    check_block_size(config, 64, "m")
    with pytest.raises(CheckpointError, match="block_size 65 exceeds the 64 positions of model m: lower 'block_size'"):
        check_block_size(config, 65, "m")


def test_parameter_names_and_shapes_are_pytorchs_state_dict():
    from safetensors import safe_open

    with safe_open(str(FIXTURES / "gpt2-tiny" / "model.safetensors"), "numpy") as handle:
        saved = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118 (no __iter__)
    shapes = parameter_shapes(config_from_json(WRITTEN_BY_TRANSFORMERS, "config.json"))
    assert shapes == saved
    assert list(shapes)[:3] == ["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.0.ln_1.weight"]


def test_checkpoint_names_without_the_base_prefix_and_ignored_buffers():
    assert checkpoint_name("h.0.attn.c_attn.bias") == "transformer.h.0.attn.c_attn.bias"
    assert checkpoint_name("transformer.wte.weight") == "transformer.wte.weight"
    assert checkpoint_name("h.3.attn.bias") is None and checkpoint_name("transformer.h.3.attn.masked_bias") is None
    assert checkpoint_name("lm_head.weight") is None
