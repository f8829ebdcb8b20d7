"""Models saved as transformers 4.57's tf_model.h5 (tasks/legacy_models.py): converted once to model.safetensors by
h5py, with exactly the weights they held, or refused naming the tensor; a registry version of one converts when a
run continues from it. The fixture (fixtures/legacy_tf_model/, made by fixtures/make_legacy_h5.py with
TFGPT2LMHeadModel) holds the golden tiny GPT-2's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tasks.legacy_models import CONVERTED_RECORD, convert_legacy_model, is_legacy_model, pytorch_name
from tests.trainer.decoders.golden import FIXTURES as GOLDEN
from tests.trainer.decoders.golden import INPUT_IDS, arrays
from trainer.decoders.architectures import CheckpointError

LEGACY = Path(__file__).resolve().parent / "fixtures" / "legacy_tf_model"


@pytest.fixture
def legacy(tmp_path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(LEGACY, model)
    return model


def test_tf_names_become_pytorchs():
    assert pytorch_name("tfgpt2lm_head_model/transformer/h_._11/ln_1/gamma:0") == "transformer.h.11.ln_1.weight"
    assert pytorch_name("tfgpt2lm_head_model_1/transformer/h_._0/attn/c_attn/bias:0") == (
        "transformer.h.0.attn.c_attn.bias")
    assert pytorch_name("tfgpt2lm_head_model/transformer/wte/embeddings:0") == "transformer.wte.weight"
    assert pytorch_name("tfgpt2lm_head_model/transformer/ln_f/beta:0") == "transformer.ln_f.bias"
    assert pytorch_name("tfgpt2lm_head_model/lm_head/bias:0") is None


def test_a_legacy_model_converts_once_to_the_weights_it_held(legacy):
    from safetensors.numpy import load_file

    from trainer.decoders.pretrained import check_checkpoint, load_pretrained

    before = {path.name: path.read_bytes() for path in legacy.iterdir()}
    assert is_legacy_model(str(legacy))
    assert convert_legacy_model(str(legacy), "Setting 'model'") is True
    converted, golden = load_file(str(legacy / "model.safetensors")), load_file(str(GOLDEN / "gpt2-tiny" /
                                                                                  "model.safetensors"))
    assert set(converted) == set(golden)
    for name, value in golden.items():
        np.testing.assert_array_equal(converted[name], value, err_msg=name)
    # Nothing that was there changes (a registry version's version.json lists those files with their sizes).
    assert {name: (legacy / name).read_bytes() for name in before} == before
    assert json.loads((legacy / CONVERTED_RECORD).read_text())["tensors"] == len(golden)
    assert check_checkpoint(str(legacy)).config.n_layer == 2
    logits = load_pretrained(legacy)(INPUT_IDS).numpy()
    assert float(np.max(np.abs(logits - arrays()["logits"]))) < 1e-5
    assert not is_legacy_model(str(legacy)) and convert_legacy_model(str(legacy), "Setting 'model'") is False


def test_a_killed_conversion_is_done_again(legacy):
    (legacy / "model.safetensors").write_bytes(b"half")  # no record: never trusted
    assert is_legacy_model(str(legacy)) and convert_legacy_model(str(legacy), "Setting 'model'") is True
    assert (legacy / "model.safetensors").stat().st_size > 1000


def test_a_legacy_model_that_does_not_fit_its_config_is_refused_naming_the_tensor_and_the_fix(legacy):
    config = json.loads((legacy / "config.json").read_text())
    (legacy / "config.json").write_text(json.dumps({**config, "n_inner": 32}))
    with pytest.raises(CheckpointError, match=r"Setting 'model' = 'promoted': .* holds transformers 4.57's "
                                              r"tf_model.h5, which could not be converted to model.safetensors \(.*"
                                              r"transformer.h.0.mlp.c_fc.weight has shape \[16, 64\], the config's "
                                              r"GPT-2 \[16, 32\]\.\)\. Promote a run trained since"):
        convert_legacy_model(str(legacy), "Setting 'model' = 'promoted'")
    assert not (legacy / "model.safetensors").exists() and is_legacy_model(str(legacy))


def test_a_directory_of_tf_weights_named_in_model_is_refused_before_training_saying_how_to_convert(legacy):
    from core.config import ConfigError, RunConfig
    from tasks.base_models import check_model_setting

    cfg = RunConfig.from_params({"model": str(legacy), "block_size": 16})
    with pytest.raises(ConfigError, match=r"holds tf_model.h5 only, transformers 4.57's TF format, .* convert this "
                                          r"one once with `python -m tasks.legacy_models <its URL>`"):
        check_model_setting(cfg)
    convert_legacy_model(str(legacy), "cli")
    check_model_setting(cfg)
