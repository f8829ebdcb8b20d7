"""Serving exports (trainer/export.py): the safetensors' names are PyTorch GPT-2's, and every format read back gives
the trained model's logits, for the `tiny` preset and for GPT-2 124M's shape (random weights, no download).

The PyTorch key set is read from transformers' own `modeling_gpt2.py` with `ast` (torch is not installed here):
the modules each `__init__` assigns, their parameters and persistent buffers, less the tied weights that PyTorch's
`save_pretrained` drops. It does not come from trainer/export.py's table, which it checks.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from core.config import MODEL_PRESETS
from trainer import export

VOCAB = 2048

# What a PyTorch leaf module saves (torch.nn and transformers.pytorch_utils.Conv1D); containers recurse.
_LEAVES = {"Conv1D": ("weight", "bias"), "LayerNorm": ("weight", "bias"), "Embedding": ("weight",),
           "Dropout": (), "Identity": (), "set": ()}  # set(): the attention's pruned heads, no tensor


def _modeling_gpt2() -> ast.Module:
    package = Path(importlib.util.find_spec("transformers").submodule_search_locations[0])
    return ast.parse((package / "models" / "gpt2" / "modeling_gpt2.py").read_text())


def _assignments(body):
    """(attribute, constructor call) of `self.x = Ctor(...)` in an __init__; a branch on cross attention takes the
    path of GPT-2 without it (add_cross_attention is False by default); persistent buffers as (name, None)."""
    for statement in body:
        if isinstance(statement, ast.If):
            yield from _assignments(statement.orelse if "cross" in ast.unparse(statement.test) else statement.body)
        elif (isinstance(statement, ast.Assign) and len(statement.targets) == 1
              and isinstance(statement.targets[0], ast.Attribute) and ast.unparse(statement.targets[0].value) == "self"
              and isinstance(statement.value, ast.Call)):
            yield statement.targets[0].attr, statement.value
        elif (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
              and ast.unparse(statement.value.func) == "self.register_buffer"):
            keywords = {keyword.arg: ast.unparse(keyword.value) for keyword in statement.value.keywords}
            if keywords.get("persistent") != "False":
                yield ast.literal_eval(statement.value.args[0]), None


def pytorch_gpt2_keys(n_layer: int) -> set[str]:
    """The state-dict keys PyTorch's `GPT2LMHeadModel.save_pretrained` writes, from transformers' source."""
    classes = {node.name: node for node in _modeling_gpt2().body if isinstance(node, ast.ClassDef)}

    def keys(class_name: str, prefix: str) -> set[str]:
        init = next(node for node in classes[class_name].body
                    if isinstance(node, ast.FunctionDef) and node.name == "__init__")
        found: set[str] = set()
        for attribute, call in _assignments(init.body):
            found |= module_keys(call, f"{prefix}{attribute}")
        return found

    def module_keys(call: ast.Call | None, name: str) -> set[str]:
        if call is None:  # a persistent buffer
            return {name}
        constructor = ast.unparse(call.func).rsplit(".", 1)[-1]
        if constructor in classes:
            return keys(constructor, name + ".")
        if constructor == "ModuleList":  # [Block(...) for i in range(config.num_hidden_layers)]
            element = call.args[0].elt
            return {key for index in range(n_layer) for key in module_keys(element, f"{name}.{index}")}
        if constructor == "Linear":
            no_bias = any(keyword.arg == "bias" and ast.unparse(keyword.value) == "False" for keyword in call.keywords)
            return {f"{name}.weight"} | (set() if no_bias else {f"{name}.bias"})
        assert constructor in _LEAVES, f"modeling_gpt2.py builds {constructor} for {name}: teach the test its params"
        return {f"{name}.{parameter}" for parameter in _LEAVES[constructor]}

    lm_head = classes["GPT2LMHeadModel"]
    attributes = {target.id: statement.value for statement in lm_head.body if isinstance(statement, ast.Assign)
                  for target in statement.targets if isinstance(target, ast.Name)}
    tied = ast.literal_eval(attributes["_tied_weights_keys"])  # 4.57: a list; transformers 5: {tied: source}
    assert "_keys_to_ignore_on_save" not in attributes  # nothing else is left out of the saved file
    return keys("GPT2LMHeadModel", "") - set(tied)


def tiny_config(**overrides):
    from transformers import GPT2Config

    settings = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0, **MODEL_PRESETS["tiny"],
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2Config(**{**settings, **overrides})


def built(config):
    from transformers import TFGPT2LMHeadModel

    model = TFGPT2LMHeadModel(config)
    model.build_in_name_scope()
    return model


def saved(model, directory: Path) -> Path:
    """`model/` as the chief writes it: save_pretrained and a tokenizer file."""
    model.save_pretrained(str(directory))
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    return directory


def prompts(count: int, tokens: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, size=(count, tokens)).astype(np.int32)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """The tiny preset exported in every format once, as the chief does (validation-like prompts: 3 x 32)."""
    root = tmp_path_factory.mktemp("tiny")
    model = built(tiny_config())
    record = export.export_formats(model, saved(model, root / "model"), root / "exports", export.FORMATS,
                                   prompts(3, 32, VOCAB))
    return model, root, record


def test_the_safetensors_hold_pytorch_gpt2s_keys_and_shapes(tiny_export):
    from safetensors import safe_open

    model, root, _ = tiny_export
    expected = pytorch_gpt2_keys(model.config.n_layer)
    assert "lm_head.weight" not in expected and "transformer.h.1.mlp.c_proj.bias" in expected
    with safe_open(str(root / "exports" / "safetensors" / "model.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": "pt"}
        names = handle.keys()  # safe_open is not iterable
        assert set(names) == expected
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    assert shapes == export.pytorch_shapes(model.config)
    # Conv1D keeps TF's [in, out]: c_attn is [64, 192]; its bias is 1-D in PyTorch ([1, 192] in TF).
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (64, 192)
    assert shapes["transformer.h.0.attn.c_attn.bias"] == (192,)


def test_every_tiny_export_reads_back_with_the_trained_models_logits(tiny_export):
    _, root, record = tiny_export
    figures = {name: result["max_abs_diff"] for name, result in record["formats"].items()}
    print(f"tiny parity (max |logit diff|, 3 prompts x 32 tokens): {figures}")
    assert set(record["formats"]) == set(export.FORMATS)
    for name, result in record["formats"].items():
        assert result["passed"] and result["greedy_identical"], (name, result["detail"])
        assert result["max_abs_diff"] <= export.PARITY_TOLERANCE
    assert record["formats"]["tf_h5"]["max_abs_diff"] == 0.0  # the same weights, the same code
    pytorch = root / "exports" / "safetensors"
    config = json.loads((pytorch / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["tie_word_embeddings"]) == (
        ["GPT2LMHeadModel"], "gpt2", True)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        path.name for path in pytorch.iterdir()}
    assert "tf_model.h5" not in {path.name for path in pytorch.iterdir()}  # each format in a folder of its own
    assert [file["name"] for file in record["formats"]["safetensors"]["files"]] == sorted(
        path.name for path in pytorch.iterdir())


def test_the_saved_model_serves_input_ids_and_attention_mask_to_logits(tiny_export):
    import tensorflow as tf

    _, root, _ = tiny_export
    serving = tf.saved_model.load(str(root / "exports" / "saved_model")).signatures["serving_default"]
    _, inputs = serving.structured_input_signature
    assert {name: (spec.dtype, spec.shape.as_list()) for name, spec in inputs.items()} == {
        "input_ids": (tf.int32, [None, None]), "attention_mask": (tf.int32, [None, None])}
    logits = serving(input_ids=tf.constant([[1, 2, 3]]), attention_mask=tf.constant([[1, 1, 1]]))["logits"]
    assert logits.shape == (1, 3, VOCAB) and logits.dtype == tf.float32


def test_the_124m_shape_exports_with_pytorch_names_shapes_and_parity(tmp_path):
    """GPT-2 124M's shape with random weights (GPT2Config's defaults), one short prompt: the formats beside TF."""
    from safetensors import safe_open
    from transformers import GPT2Config

    model = built(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size) == (12, 768, 50257)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text("{}")
    record = export.export_formats(model, model_dir, tmp_path / "exports", ("safetensors", "saved_model"),
                                   prompts(1, 8, 50257))
    figures = {name: result["max_abs_diff"] for name, result in record["formats"].items()}
    print(f"124M parity (max |logit diff|, 1 prompt x 8 tokens): {figures}")
    for name, result in record["formats"].items():
        assert result["passed"], (name, result["detail"])
    with safe_open(str(tmp_path / "exports" / "safetensors" / "model.safetensors"), "np") as handle:
        names = handle.keys()
        assert set(names) == pytorch_gpt2_keys(12)
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    assert shapes == export.pytorch_shapes(model.config)
    assert shapes["transformer.h.11.mlp.c_fc.weight"] == (768, 3072)
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == 124_439_808  # GPT-2 small's parameter count


def test_an_export_that_differs_or_fails_is_recorded_failed_naming_it(tmp_path, monkeypatch):
    """A safetensors whose one tensor is off by 1e-3 fails parity with its figure; a SavedModel that cannot be
    written fails with the error, and nothing half-written is left for publishing."""
    model = built(tiny_config())
    original = export.pytorch_state_dict

    def nudged(source):
        tensors = original(source)
        tensors["transformer.h.0.mlp.c_fc.bias"] = tensors["transformer.h.0.mlp.c_fc.bias"] + np.float32(0.5)
        return tensors

    def broken(*_):
        (tmp_path / "exports" / "saved_model").mkdir(parents=True)
        (tmp_path / "exports" / "saved_model" / "saved_model.pb").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(export, "pytorch_state_dict", nudged)
    monkeypatch.setattr(export, "write_saved_model", broken)
    record = export.export_formats(model, saved(model, tmp_path / "model"), tmp_path / "exports",
                                   ("safetensors", "saved_model"), prompts(2, 16, VOCAB))
    safetensors, saved_model = record["formats"]["safetensors"], record["formats"]["saved_model"]
    assert safetensors["passed"] is False and safetensors["max_abs_diff"] > export.PARITY_TOLERANCE
    assert "max |logit diff|" in safetensors["detail"] and "(limit 1e-04)" in safetensors["detail"]
    assert saved_model["passed"] is False and saved_model["detail"] == "export failed: OSError: disk full"
    assert saved_model["files"] == [] and not (tmp_path / "exports" / "saved_model").exists()


def test_a_mixed_precision_model_with_resized_embeddings_is_compared_in_float32(tmp_path):
    """A bf16 run is compared through a float32 copy of its weights, by name: a hub model resized to the dataset's
    vocabulary (resize_token_embeddings) keeps its embeddings last among its weights."""
    import tf_keras

    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = built(tiny_config(vocab_size=300))
        model.resize_token_embeddings(VOCAB)
        assert model.compute_dtype == "bfloat16" and model.weights[-1].shape == (VOCAB, 64)
        record = export.export_formats(model, saved(model, tmp_path / "model"), tmp_path / "exports",
                                       export.FORMATS, prompts(1, 16, VOCAB))
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert all(result["passed"] for result in record["formats"].values()), record["formats"]


def test_the_numpy_forward_masks_padding_like_the_tf_model():
    """Keys masked out by attention_mask change nothing for the positions before them, as in PyTorch's GPT-2."""
    model = built(tiny_config())
    tensors = export.pytorch_state_dict(model)
    tokens = prompts(1, 12, VOCAB)
    whole = export.gpt2_logits(tensors, model.config, tokens)
    padded = export.gpt2_logits(tensors, model.config, tokens, attention_mask=np.array([[1] * 8 + [0] * 4]))
    np.testing.assert_allclose(padded[:, :8], whole[:, :8], atol=1e-6)
    np.testing.assert_allclose(whole, export.model_logits(model, tokens), atol=export.PARITY_TOLERANCE)
