"""Hugging Face checkpoints read and written by the decoders: bf16, fp16 and sharded reads, the written layout,
round trips through local and object storage, embedding resizes, and every bad input refused before a weight is
read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.trainer.decoders.golden import FIXTURES, INPUT_IDS, arrays
from trainer.decoders.architectures import CheckpointError

LOGITS_TOLERANCE = 1e-5
TRANSFORMERS_FILES = ["config.json", "generation_config.json", "model.safetensors"]  # what save_pretrained writes


def _tensors(directory) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(directory / "model.safetensors"))


def _copy(tmp_path, name="gpt2-tiny"):
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    return directory


@pytest.mark.parametrize(("checkpoint", "reference"), [
    ("gpt2-tiny-bf16", "bf16_logits"), ("gpt2-tiny-sharded", "logits")])
def test_bfloat16_and_sharded_checkpoints_read_as_pytorch_reads_them(checkpoint, reference):
    from trainer.decoders.pretrained import load_pretrained

    logits = load_pretrained(FIXTURES / checkpoint)(INPUT_IDS).numpy()
    assert np.max(np.abs(logits - arrays()[reference])) <= LOGITS_TOLERANCE


def test_a_float16_checkpoint_reads_as_its_float32_values(tmp_path):
    from safetensors.numpy import save_file

    from trainer.decoders.pretrained import load_pretrained

    directory = _copy(tmp_path)
    halves = {name: value.astype(np.float16) for name, value in _tensors(directory).items()}
    save_file(halves, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model = load_pretrained(directory)
    for name, variable in model.weights.items():
        np.testing.assert_array_equal(variable.numpy(), halves[name].astype(np.float32))


def test_a_checkpoint_saved_from_gpt2model_with_buffers_and_a_head_reads_the_same(tmp_path):
    """openai-community/gpt2's layout: no `transformer.` prefix, the attention's mask buffers saved."""
    from safetensors.numpy import save_file

    from trainer.decoders.pretrained import load_pretrained

    directory = _copy(tmp_path)
    tensors = {name.removeprefix("transformer."): value for name, value in _tensors(directory).items()}
    tensors |= {f"h.{layer}.attn.bias": np.tril(np.ones((1, 1, 32, 32), np.float32)) for layer in range(2)}
    tensors["lm_head.weight"] = tensors["wte.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    logits = load_pretrained(directory)(INPUT_IDS).numpy()
    assert np.max(np.abs(logits - arrays()["logits"])) <= LOGITS_TOLERANCE


def test_save_then_load_is_bit_exact_and_writes_what_transformers_5_writes(tmp_path):
    import tensorflow as tf

    from trainer.decoders.pretrained import load_pretrained, save_pretrained

    model = load_pretrained(FIXTURES / "gpt2-tiny")
    save_pretrained(model, str(tmp_path / "same"))
    # The weights PyTorch saved, written back: the same bytes as transformers 5 + safetensors wrote.
    assert (tmp_path / "same" / "model.safetensors").read_bytes() == \
        (FIXTURES / "gpt2-tiny" / "model.safetensors").read_bytes()
    model.weights["transformer.h.1.mlp.c_fc.weight"].assign_add(tf.fill([16, 64], 0.125))
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "config.json").write_text("{}")  # a model file of the tokenizer's directory: not copied
    names = save_pretrained(model, str(tmp_path / "out"), tokenizer_dir=tokenizer)
    assert names == sorted(TRANSFORMERS_FILES + ["tokenizer.json"])
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == names

    written, reference = _tensors(tmp_path / "out"), _tensors(FIXTURES / "gpt2-tiny")
    assert list(written) == list(reference) and "lm_head.weight" not in written
    assert all(value.dtype == np.float32 for value in written.values())
    for name, variable in model.weights.items():
        np.testing.assert_array_equal(written[name], variable.numpy())
    for name in ("config.json", "generation_config.json"):
        expected = json.loads((FIXTURES / "gpt2-tiny" / name).read_text())
        del expected["transformers_version"]
        assert json.loads((tmp_path / "out" / name).read_text()) == expected

    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "numpy") as handle:
        assert handle.metadata() == {"format": "pt"}
    again = load_pretrained(tmp_path / "out")
    np.testing.assert_array_equal(again(INPUT_IDS).numpy(), model(INPUT_IDS).numpy())


def test_object_storage_checkpoints_are_staged_read_and_written(s3_bucket, tmp_path):
    from core import storage
    from trainer.decoders.pretrained import load_pretrained, save_pretrained

    url = storage.join(s3_bucket, "models", "tiny")
    storage.upload_tree(FIXTURES / "gpt2-tiny-sharded", url)
    model = load_pretrained(url, work_dir=tmp_path / "work")
    assert np.max(np.abs(model(INPUT_IDS).numpy() - arrays()["logits"])) <= LOGITS_TOLERANCE
    copy = storage.join(s3_bucket, "models", "copy")
    save_pretrained(model, copy)
    assert list(storage.list_dir(copy)) == TRANSFORMERS_FILES
    np.testing.assert_array_equal(load_pretrained(copy)(INPUT_IDS).numpy(), model(INPUT_IDS).numpy())


def test_a_larger_tokenizer_grows_the_embedding_and_a_smaller_one_drops_rows():
    from trainer.decoders.pretrained import load_pretrained

    embedding = _tensors(FIXTURES / "gpt2-tiny")["transformer.wte.weight"]
    grown = load_pretrained(FIXTURES / "gpt2-tiny", vocab_size=130, seed=5)
    rows = grown.weights["transformer.wte.weight"].numpy()
    assert grown.config.vocab_size == 130 and grown(INPUT_IDS).shape == (2, 16, 130)
    np.testing.assert_array_equal(rows[:100], embedding)
    spread = grown.config.initializer_range  # truncated normal(0, spread) at two spreads
    assert np.all(np.abs(rows[100:]) <= 2 * spread) and np.std(rows[100:]) > spread / 2
    same = load_pretrained(FIXTURES / "gpt2-tiny", vocab_size=130, seed=5).weights["transformer.wte.weight"]
    np.testing.assert_array_equal(same.numpy(), rows)
    shrunk = load_pretrained(FIXTURES / "gpt2-tiny", vocab_size=90)
    np.testing.assert_array_equal(shrunk.weights["transformer.wte.weight"].numpy(), embedding[:90])


def _refuse_weight_reads(patch: pytest.MonkeyPatch) -> None:
    """Fail the test if a weight file is opened or downloaded: refusals come before either."""
    import safetensors

    from core import storage

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the checkpoint was refused")

    patch.setattr(safetensors, "safe_open", refuse)
    patch.setattr(storage, "download_file", refuse)


@pytest.fixture
def no_weight_read(monkeypatch):
    _refuse_weight_reads(monkeypatch)


def _rewrite(directory, change):
    from safetensors.numpy import save_file

    tensors = _tensors(directory)
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.pop("transformer.h.1.ln_2.bias"), r"missing tensor transformer.h.1.ln_2.bias \[16\]"),
    (lambda t: t.update({"transformer.h.2.ln_1.weight": np.ones(16, np.float32)}),
     r"extra tensor transformer.h.2.ln_1.weight \[16\] \(the model has no such weight\)"),
    (lambda t: t.update({"transformer.wpe.weight": np.ones((16, 16), np.float32)}),
     r"tensor transformer.wpe.weight has shape \[16, 16\], the model's is \[32, 16\]"),
    (lambda t: t.update({"transformer.ln_f.bias": np.ones(16, np.float64)}),
     "tensor transformer.ln_f.bias has dtype F64: supported are F32, BF16, F16"),
])
def test_a_tensor_that_does_not_fit_is_refused_by_name_before_any_weight_is_read(tmp_path, change, message):
    from trainer.decoders.pretrained import load_pretrained

    directory = _copy(tmp_path)
    _rewrite(directory, change)
    with pytest.MonkeyPatch.context() as patch:
        _refuse_weight_reads(patch)
        with pytest.raises(CheckpointError, match=f"{directory} does not fit its config.json: {message}"):
            load_pretrained(directory)


def test_an_object_storage_checkpoint_is_refused_before_its_weights_are_downloaded(s3_bucket, tmp_path):
    from core import storage
    from trainer.decoders.pretrained import load_pretrained

    directory = _copy(tmp_path)
    _rewrite(directory, lambda tensors: tensors.pop("transformer.ln_f.weight"))
    url = storage.join(s3_bucket, "models", "broken")
    storage.upload_tree(directory, url)
    with pytest.MonkeyPatch.context() as patch:
        _refuse_weight_reads(patch)
        with pytest.raises(CheckpointError, match=r"missing tensor transformer.ln_f.weight \[16\]"):
            load_pretrained(url, work_dir=tmp_path / "work")
    assert not (tmp_path / "work").exists()


def test_other_architectures_escaping_shards_and_long_blocks_are_refused_before_any_weight_is_read(
        tmp_path, no_weight_read):
    from trainer.decoders.pretrained import load_pretrained

    other = _copy(tmp_path)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(CheckpointError, match="MistralForCausalLM.*supported architectures are GPT2LMHeadModel"):
        load_pretrained(other)

    sharded = _copy(tmp_path, "gpt2-tiny-sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    index["weight_map"]["transformer.wpe.weight"] = "../gpt2-tiny/model.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard '../gpt2-tiny/model.safetensors', which is not a file of"):
        load_pretrained(sharded)

    with pytest.raises(CheckpointError, match="block_size 64 exceeds the 32 positions of model"):
        load_pretrained(FIXTURES / "gpt2-tiny", block_size=64)
    with pytest.raises(CheckpointError, match="config.json is missing: .* is not a Hugging Face checkpoint"):
        load_pretrained(tmp_path / "nothing")


def test_a_checkpoint_is_checked_without_tensorflow():
    """What runs before a worker starts (an Airflow task) checks a checkpoint without importing TensorFlow."""
    import subprocess
    import sys

    script = ("import sys; from trainer.decoders.pretrained import check_checkpoint; "
              f"checked = check_checkpoint({str(FIXTURES / 'gpt2-tiny-sharded')!r}, block_size=32); "
              "print(len(checked.tensors), 'tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["28", "False"]


def test_a_preset_builds_with_the_tokenizer_vocabulary_and_refuses_a_long_block():
    from trainer.decoders.pretrained import build_preset

    model = build_preset("tiny", vocab_size=300, eos_token_id=1, block_size=256)
    assert model(INPUT_IDS).shape == (2, 16, 300) and model.config.eos_token_id == 1
    with pytest.raises(CheckpointError, match="block_size 512 exceeds the 256 positions of model preset 'tiny'"):
        build_preset("tiny", vocab_size=300, eos_token_id=1, block_size=512)
