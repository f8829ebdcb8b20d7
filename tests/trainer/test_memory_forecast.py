"""trainer/memory_forecast.py: where one worker's memory goes, and the preflight's refusal of a run that cannot fit
its GPU (the fake NVML of tests/support/fake_nvml.py: an H200 with another tenant's memory on it)."""

from __future__ import annotations

import dataclasses

import pytest

from core.config import RunConfig
from core.storage import read_json
from tests.support.fake_nvml import GIB, MEASURED_IDLE_USED_BYTES, FakeNvml, h200s, install
from tests.trainer.preflight import workers
from trainer.lora_plan import lora_plan
from trainer.memory_forecast import MIB, Workload, fit_error, forecast, run_forecast
from trainer.model_shapes import decoder_shape
from trainer.preflight import checks

GPT2 = decoder_shape({"model_type": "gpt2"})  # 124M
LLAMA_8B = decoder_shape({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                          "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                          "vocab_size": 128256})


def test_full_training_keeps_20_bytes_per_parameter_before_activations():
    """Weights, AdamW's two moments, and the gradients twice: as the backward pass gives them and clipped."""
    parameters = GPT2.matrix_parameters() + GPT2.vector_parameters()
    full = forecast(GPT2, Workload(batch=8, block_size=1024))
    assert (full.weights, full.gradients, full.optimizer) == (4 * parameters, 8 * parameters, 8 * parameters)
    assert forecast(GPT2, Workload(batch=8, block_size=1024, grad_accum_steps=4)).gradients == 12 * parameters
    # An 8B model's weights, gradients and moments alone exceed an H200's 140 GiB.
    assert forecast(LLAMA_8B, Workload(batch=1, block_size=1024)).total > 140 * GIB


def test_lora_bf16_base_and_recompute_each_shrink_their_part():
    full = forecast(LLAMA_8B, Workload(batch=1, block_size=2048))
    plan = lora_plan(LLAMA_8B, rank=16, alpha=32, targets=())
    lora = forecast(LLAMA_8B, Workload(batch=1, block_size=2048, trainable=plan.parameters))
    lora_bf16 = Workload(batch=1, block_size=2048, trainable=plan.parameters, base_weights_dtype="bfloat16")
    half = forecast(LLAMA_8B, lora_bf16)
    lean = forecast(LLAMA_8B, dataclasses.replace(lora_bf16, recompute=True))
    assert lora.optimizer == 8 * plan.parameters and plan.parameters < 0.01 * (full.optimizer / 8)
    assert half.weights < 0.51 * lora.weights
    assert lean.activations < half.activations / 10 and lean.total < 40 * GIB < full.total


def test_a_bfloat16_base_under_bf16_compute_keeps_no_cast_copy_but_a_float32_one_does():
    plan = lora_plan(LLAMA_8B, rank=8, alpha=16, targets=())
    matrices = LLAMA_8B.matrix_parameters()

    def weights(base: str, precision: str) -> int:
        return forecast(LLAMA_8B, Workload(batch=1, block_size=2048, mixed_precision=precision,
                                           trainable=plan.parameters, base_weights_dtype=base)).weights

    assert weights("bfloat16", "bf16") == weights("bfloat16", "no") < 17 * GIB  # 8B in bfloat16: 15 GiB
    assert weights("bfloat16", "fp16") == weights("bfloat16", "no") + 2 * matrices
    assert weights("float32", "bf16") == weights("float32", "no") + 2 * matrices
    full = forecast(LLAMA_8B, Workload(batch=1, block_size=2048, mixed_precision="bf16"))
    assert full.weights == 4 * (matrices + LLAMA_8B.vector_parameters()) + 2 * matrices


def test_the_refusal_names_the_parts_and_the_levers_the_run_does_not_use():
    cfg = RunConfig(model="gpt2-124m", batch_size_per_worker=64, block_size=1024, use_gpu=True)
    predicted = run_forecast(cfg, decoder_shape({"model_type": "gpt2", "vocab_size": 50257}))
    message = fit_error(cfg, predicted, 8000, "rank 1 on gpu-b")
    assert message.startswith(f"rank 1 on gpu-b: the training forecast is {predicted.total / MIB:,.0f} MiB per worker")
    for lever in ("'batch_size_per_worker' (now 64)", "'grad_accum_steps'", "'num_workers'", "'recompute'",
                  "'adapter' to 'lora'", "'mixed_precision' to 'bf16'"):
        assert lever in message, lever
    assert fit_error(cfg, predicted, predicted.total // MIB + 1, "rank 1") is None


@pytest.mark.parametrize("held_gib, refused", [(100, False), (139, True)])
def test_preflight_refuses_a_run_over_its_gpus_free_memory(tmp_path, monkeypatch, held_gib, refused):
    nvml = install(monkeypatch, FakeNvml(h200s(1)))
    nvml.start_process(0, held_gib * GIB - MEASURED_IDLE_USED_BYTES)  # another tenant's memory
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    paths = workers.dataset(tmp_path, num_workers=1)
    saved = read_json(paths["config"])
    cfg = RunConfig.from_saved({**saved, "use_gpu": True, "batch_size_per_worker": 1024})
    report = checks.check_worker(cfg, paths["manifest"], workers.identity(0, 1))
    memory = report["memory"]
    assert memory["gpu_free_mb"] == 143771 - held_gib * 1024 - 780
    assert 655 < memory["forecast_mb"]["total"] < 143771 - 100 * 1024 - 780  # 1,414 MiB: fits only beside 100 GiB
    errors = [e for e in report["errors"] if "training forecast" in e]
    assert bool(errors) is refused
    if refused:
        assert "rank 0 on host-a" in errors[0] and "set 'recompute' to true" in errors[0]


@pytest.mark.parametrize("model, target, architecture",
                         [("tiny", "q_proj", "GPT-2"), ("tiny-llama", "c_attn", "Llama")])
def test_preflight_refuses_a_lora_target_the_model_lacks(tmp_path, model, target, architecture):
    paths = workers.dataset(tmp_path, num_workers=1)
    cfg = RunConfig.from_saved({**read_json(paths["config"]), "model": model, "adapter": "lora",
                                "lora_targets": [target]})
    report = checks.check_worker(cfg, paths["manifest"], workers.identity(0, 1))
    assert any(f"'lora_targets' names ['{target}'], which {architecture} lacks" in e for e in report["errors"]), \
        report["errors"]
