"""trainer/adapter_export.py: the adapter in PEFT's layout, and the exact base it names."""

from __future__ import annotations

import json

import pytest
from safetensors.numpy import load_file

from core.config import RunConfig
from trainer.adapter_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, base_identity, directory_fingerprint, write_adapter
from trainer.decoders import llama_config
from trainer.decoders.gpt2_config import preset_config
from trainer.decoders.pretrained import build_decoder
from trainer.lora import attach_lora
from trainer.lora_plan import plan_for_decoder


def test_the_adapter_is_written_with_pefts_keys_shapes_and_config(tmp_path):
    cfg = RunConfig(adapter="lora", lora_rank=4, lora_alpha=8, lora_targets=("c_attn", "c_fc"), seed=9)
    model = build_decoder(preset_config("tiny", vocab_size=320, eos_token_id=0), seed=9)
    adapters = attach_lora(model, plan_for_decoder(cfg, model.config), seed=cfg.seed)
    config = write_adapter(cfg, adapters, str(tmp_path / "adapter"))
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert sorted(tensors) == sorted(f"base_model.model.transformer.h.{layer}.{module}.lora_{m}.weight"
                                     for layer in (0, 1) for module in ("attn.c_attn", "mlp.c_fc") for m in "AB")
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"].shape == (192, 4)
    assert not tensors["base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight"].any()  # B starts at zero
    written = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert written == config
    assert {key: written[key] for key in ("peft_type", "r", "lora_alpha", "target_modules", "fan_in_fan_out",
                                           "base_model_name_or_path", "revision")} == {
        "peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True,
        "base_model_name_or_path": "preset:tiny", "revision": "seed:9"}


def test_a_llama_adapter_has_pefts_linear_keys_and_fan_in_fan_out_false(tmp_path):
    cfg = RunConfig(model="tiny-llama", adapter="lora", lora_rank=4, lora_alpha=8, lora_targets=("q_proj", "k_proj"),
                    seed=5)
    model = build_decoder(llama_config.preset_config("tiny-llama", vocab_size=320, eos_token_id=0), seed=5)
    adapters = attach_lora(model, plan_for_decoder(cfg, model.config), seed=cfg.seed)
    config = write_adapter(cfg, adapters, str(tmp_path / "adapter"))
    tensors = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert sorted(tensors) == sorted(f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{m}.weight"
                                     for layer in (0, 1) for module in ("q_proj", "k_proj") for m in "AB")
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 4)  # 2 kv heads
    assert {key: config[key] for key in ("target_modules", "fan_in_fan_out", "base_model_name_or_path", "revision")} \
        == {"target_modules": ["k_proj", "q_proj"], "fan_in_fan_out": False,
            "base_model_name_or_path": "preset:tiny-llama", "revision": "seed:5"}


def test_the_base_is_named_by_its_pinned_commit_or_its_content(tmp_path):
    cached = tmp_path / "models" / "base" / ("gpt2@" + "c" * 40)
    cached.mkdir(parents=True)
    (cached / "base_model.json").write_text(json.dumps({"name": "openai-community/gpt2", "sha": "c" * 40}))
    assert base_identity(RunConfig(model=str(cached), model_revision="c" * 40)) == {
        "base_model_name_or_path": "openai-community/gpt2", "revision": "c" * 40}
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"weights")
    (local / "README.md").write_text("not part of the model")
    first = base_identity(RunConfig(model=str(local)))
    assert first == {"base_model_name_or_path": str(local), "revision": directory_fingerprint(local)}
    (local / "README.md").write_text("edited")
    assert base_identity(RunConfig(model=str(local)))["revision"] == first["revision"]
    (local / "model.safetensors").write_bytes(b"other weights")
    assert base_identity(RunConfig(model=str(local)))["revision"] != first["revision"]


def test_a_damaged_base_record_is_refused_by_name(tmp_path):
    (tmp_path / "base_model.json").write_text(json.dumps({"name": 3}))
    with pytest.raises(ValueError, match="names no hub model and commit"):
        base_identity(RunConfig(model=str(tmp_path), model_revision="main"))
