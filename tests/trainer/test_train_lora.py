"""trainer.train with LoRA as real worker processes on loopback: 2 workers follow the 1-worker baseline's curve
(that one with recomputed blocks), only the adapters cross the network and reach the checkpoint, the base comes out
bit for bit unchanged in the merged model (GPT-2's and tiny-llama's), and a bfloat16 base trains too."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.trainer.test_train import LOSS_TOLERANCE, Job, manifest  # noqa: F401 - the module's dataset fixture

STEPS = 12
LORA = {"adapter": "lora", "lora_rank": 4, "lora_alpha": 8, "max_steps": STEPS, "checkpoint_every_steps": STEPS,
        "learning_rate": 1e-2, "warmup_steps": 2, "export_formats": ["safetensors"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, manifest) -> dict[str, Job]:  # noqa: F811
    root = tmp_path_factory.mktemp("lora-runs")
    jobs = {
        "single": Job(root, "single", manifest, num_workers=1, grad_accum_steps=2, recompute=True, **LORA),
        "pair": Job(root, "pair", manifest, num_workers=2, grad_accum_steps=1, **LORA),
        "bf16": Job(root, "bf16", manifest, num_workers=2, grad_accum_steps=1, base_weights_dtype="bfloat16",
                    **LORA),
        "llama": Job(root, "llama", manifest, num_workers=2, grad_accum_steps=1, model="tiny-llama", recompute=True,
                     **{**LORA, "lora_targets": ["q_proj", "v_proj", "down_proj"],
                        "export_formats": ["safetensors", "saved_model"]}),
    }
    try:
        for job in jobs.values():
            job.start()
        for job in jobs.values():
            job.assert_succeeded(job.wait())
        # Started again on its output: it restores the adapters' checkpoint at the last step and exports again.
        jobs["single"].start()
        jobs["single"].assert_succeeded(jobs["single"].wait())
    finally:
        for job in jobs.values():
            job.stop()
    return jobs


def test_two_lora_workers_follow_the_recomputed_single_worker_curve(runs):
    single, pair = runs["single"].losses(), runs["pair"].losses()
    assert sorted(single) == sorted(pair) == list(range(1, STEPS + 1))
    worst = max(abs(single[s] - pair[s]) for s in single)
    assert worst < LOSS_TOLERANCE, f"loss curves differ by up to {worst}"
    assert single[STEPS] < single[1] - 0.1, "the adapters did not learn"
    bf16 = runs["bf16"].losses()
    assert bf16[STEPS] < bf16[1] - 0.1 and abs(bf16[1] - pair[1]) < 0.05


def test_only_the_adapters_are_all_reduced_and_checkpointed(runs):
    import tensorflow as tf

    job = runs["pair"]
    summary = job.summary()
    # tiny: 2 blocks x (c_attn 64->192, c_proj 64->64, c_fc 64->256, c_proj 256->64) at rank 4.
    adapter_parameters = 2 * 4 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
    assert summary["parameters"] == adapter_parameters and len(summary["variable_parameters"]) == 16
    assert summary["allreduce"]["packs"] == 1
    assert f"gradients: 16 tensors, {adapter_parameters * 4 / 2**20:.2f} MiB in float32 per step" in job.log(0)
    names = [name for name, _ in tf.train.list_variables(str(job.output / "checkpoints" / f"ckpt-{STEPS}"))]
    assert any(name.startswith("adapters/") for name in names)
    assert not any(name.startswith("model/") for name in names)
    moments = [name for name in names if name.startswith("optimizer/") and "moments" in name]
    assert len(moments) == 2 * 16, moments  # AdamW's m and v for the adapters alone
    memory = summary["memory"]
    assert memory["forecast_mb"]["optimizer"] == round(8 * adapter_parameters / 2**20, 1)
    assert memory["peak_rss_mb"] > 0


def test_the_merged_model_is_the_untouched_base_plus_the_adapter(runs):
    from trainer.decoders.pretrained import build_preset
    from trainer.lora_plan import lora_plan
    from trainer.model_shapes import shape_of

    job = runs["pair"]
    merged = load_file(job.output / "model" / "model.safetensors")
    adapter = load_file(job.output / "adapter" / "adapter_model.safetensors")
    config = json.loads((job.output / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("preset:tiny", "seed:1234")
    base = build_preset("tiny", vocab_size=320, eos_token_id=0,  # the weights depend on the seed and names only
                        block_size=32, seed=1234)
    plan = lora_plan(shape_of(base.config), rank=4, alpha=8, targets=())
    adapted = {module.path + ".weight" for module in plan.modules}
    for name, variable in base.weights.items():
        if name not in adapted:
            np.testing.assert_array_equal(merged[name], variable.numpy(), err_msg=name)  # bit for bit
            continue
        key = "base_model.model." + name.removesuffix(".weight")
        delta = (adapter[key + ".lora_B.weight"] @ adapter[key + ".lora_A.weight"]).T * np.float32(2.0)
        np.testing.assert_allclose(merged[name], variable.numpy() + delta, atol=1e-6, err_msg=name)
        assert np.abs(delta).max() > 1e-4, name
    exports = json.loads((job.output / "exports" / "exports.json").read_text())
    assert exports["formats"]["safetensors"]["passed"], exports["formats"]


def test_a_lora_run_resumes_from_its_adapters_checkpoint(runs):
    job = runs["single"]
    assert "restored checkpoint" in job.log(0) and f"resuming at step {STEPS} of {STEPS}" in job.log(0)
    assert job.summary()["resumed_from_step"] == STEPS and job.summary()["final_loss"] == job.losses()[STEPS]


def test_a_tiny_llama_lora_run_merges_untransposed_and_passes_both_parity_gates(runs):
    from trainer.decoders.pretrained import build_preset

    job = runs["llama"]
    losses = job.losses()
    assert losses[STEPS] < losses[1] - 0.05, "the adapters did not learn"  # 3 of 7 projections adapted
    merged = load_file(job.output / "model" / "model.safetensors")
    adapter = load_file(job.output / "adapter" / "adapter_model.safetensors")
    config = json.loads((job.output / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"], config["fan_in_fan_out"]) == (
        "preset:tiny-llama", "seed:1234", False)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"] and len(adapter) == 2 * 3 * 2
    base = build_preset("tiny-llama", vocab_size=320, eos_token_id=0, block_size=32, seed=1234)
    for name, variable in base.weights.items():
        key = "base_model.model." + name.removesuffix(".weight")
        if key + ".lora_A.weight" not in adapter:
            np.testing.assert_array_equal(merged[name], variable.numpy(), err_msg=name)  # bit for bit
            continue
        delta = adapter[key + ".lora_B.weight"] @ adapter[key + ".lora_A.weight"] * np.float32(2.0)  # [out, in]
        np.testing.assert_allclose(merged[name], variable.numpy() + delta, atol=1e-6, err_msg=name)
        assert np.abs(delta).max() > 1e-4, name
    formats = json.loads((job.output / "exports" / "exports.json").read_text())["formats"]
    assert formats["safetensors"]["passed"] and formats["saved_model"]["passed"], formats
