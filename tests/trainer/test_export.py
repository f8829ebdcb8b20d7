"""Serving exports (trainer/export.py): the model directory's tensors carry PyTorch GPT-2's names, and every format
read back gives the trained model's logits, for the `tiny` preset and for GPT-2 124M's shape (random weights, no
download).

The PyTorch key set is read from transformers' own `modeling_gpt2.py` with `ast` (torch is not installed here):
the modules each `__init__` assigns, their parameters and persistent buffers, less the tied weights that PyTorch's
`save_pretrained` drops. It does not come from the decoder's table, which it checks.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

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



def decoder(vocab: int = VOCAB, *, compute_dtype: str = "float32", seed: int = 0):
    from trainer.decoders.pretrained import build_preset

    return build_preset("tiny", vocab_size=vocab, eos_token_id=0, block_size=32, compute_dtype=compute_dtype,
                        seed=seed)


def saved(model, directory: Path) -> Path:
    """`model/` as the chief writes it: save_pretrained with a tokenizer file beside the weights."""
    from trainer.decoders.pretrained import save_pretrained

    tokenizer = directory.parent / f"{directory.name}-tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    (tokenizer / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    save_pretrained(model, str(directory), tokenizer_dir=tokenizer)
    return directory


def prompts(count: int, tokens: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, vocab, size=(count, tokens)).astype(np.int32)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """The tiny preset saved and checked in every format once, as the chief does (validation-like prompts: 3 x 32)."""
    root = tmp_path_factory.mktemp("tiny")
    model = decoder()
    record = export.export_formats(model, saved(model, root / "model"), root / "exports", export.FORMATS,
                                   prompts(3, 32, VOCAB))
    return model, root, record


def test_the_model_directory_holds_pytorch_gpt2s_keys_and_shapes(tiny_export):
    from safetensors import safe_open

    model, root, _ = tiny_export
    expected = pytorch_gpt2_keys(model.config.n_layer)
    assert "lm_head.weight" not in expected and "transformer.h.1.mlp.c_proj.bias" in expected
    with safe_open(str(root / "model" / "model.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": "pt"}
        names = handle.keys()  # safe_open is not iterable
        assert set(names) == expected
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    assert shapes == {name: tuple(variable.shape) for name, variable in model.weights.items()}
    # Conv1D's [in, out]: c_attn is [64, 192]; its bias is 1-D.
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (64, 192)
    assert shapes["transformer.h.0.attn.c_attn.bias"] == (192,)


def test_every_tiny_format_reads_back_with_the_trained_models_logits(tiny_export):
    _, root, record = tiny_export
    figures = {name: result["max_abs_diff"] for name, result in record["formats"].items()}
    print(f"tiny parity (max |logit diff|, 3 prompts x 32 tokens): {figures}")
    assert set(record["formats"]) == set(export.FORMATS) == {"safetensors", "saved_model"}
    assert record["format_version"] == 2
    for name, result in record["formats"].items():
        assert result["passed"] and result["greedy_identical"], (name, result["detail"])
        assert result["max_abs_diff"] <= export.PARITY_TOLERANCE
    model_dir = root / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["tie_word_embeddings"]) == (
        ["GPT2LMHeadModel"], "gpt2", True)
    names = {path.name for path in model_dir.iterdir()}
    assert names == {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"}
    assert record["formats"]["safetensors"]["dir"] == "model"
    assert [file["name"] for file in record["formats"]["safetensors"]["files"]] == sorted(names)
    saved_model = {path.name for path in (root / "exports" / "saved_model").iterdir()}
    assert "tokenizer.json" in saved_model and "model.safetensors" not in saved_model


def test_the_saved_model_serves_input_ids_and_attention_mask_to_logits(tiny_export):
    import tensorflow as tf

    _, root, _ = tiny_export
    serving = tf.saved_model.load(str(root / "exports" / "saved_model")).signatures["serving_default"]
    _, inputs = serving.structured_input_signature
    assert {name: (spec.dtype, spec.shape.as_list()) for name, spec in inputs.items()} == {
        "input_ids": (tf.int32, [None, None]), "attention_mask": (tf.int32, [None, None])}
    logits = serving(input_ids=tf.constant([[1, 2, 3]]), attention_mask=tf.constant([[1, 1, 1]]))["logits"]
    assert logits.shape == (1, 3, VOCAB) and logits.dtype == tf.float32
    # Padding on the right leaves the real tokens' logits as they were (causal attention).
    padded = serving(input_ids=tf.constant([[1, 2, 3, 0]]), attention_mask=tf.constant([[1, 1, 1, 0]]))["logits"]
    np.testing.assert_allclose(padded[:, :3].numpy(), logits.numpy(), atol=1e-6)


def test_the_saved_model_refuses_a_mask_it_cannot_honour(tiny_export):
    """The decoder has no padding mask: left padding (or a hole) would silently change the logits, so it fails."""
    import tensorflow as tf

    _, root, _ = tiny_export
    serving = tf.saved_model.load(str(root / "exports" / "saved_model")).signatures["serving_default"]
    for mask in ([[0, 1, 1]], [[1, 0, 1]], [[1, 2, 1]]):
        with pytest.raises(tf.errors.InvalidArgumentError, match="padding on the right only"):
            serving(input_ids=tf.constant([[1, 2, 3]]), attention_mask=tf.constant(mask))


def test_the_124m_shape_exports_with_pytorch_names_shapes_and_parity(tmp_path):
    """GPT-2 124M's shape with random weights (GPT2Config's defaults), one short prompt."""
    from safetensors import safe_open

    from trainer.decoders.gpt2_config import GPT2Config
    from trainer.decoders.pretrained import build_decoder

    model = build_decoder(GPT2Config())
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size) == (12, 768, 50257)
    record = export.export_formats(model, saved(model, tmp_path / "model"), tmp_path / "exports", export.FORMATS,
                                   prompts(1, 8, 50257))
    figures = {name: result["max_abs_diff"] for name, result in record["formats"].items()}
    print(f"124M parity (max |logit diff|, 1 prompt x 8 tokens): {figures}")
    for name, result in record["formats"].items():
        assert result["passed"], (name, result["detail"])
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "np") as handle:
        names = handle.keys()
        assert set(names) == pytorch_gpt2_keys(12)
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    assert shapes["transformer.h.11.mlp.c_fc.weight"] == (768, 3072)
    assert sum(int(np.prod(shape)) for shape in shapes.values()) == 124_439_808  # GPT-2 small's parameter count


def test_a_format_that_differs_or_fails_is_recorded_failed_naming_it(tmp_path, monkeypatch):
    """A model directory whose one tensor is off by 0.5 fails parity with its figure; a SavedModel that cannot be
    written fails with the error, and nothing half-written is left for publishing."""
    from safetensors.numpy import load_file, save_file

    model = decoder()
    model_dir = saved(model, tmp_path / "model")
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["transformer.h.0.mlp.c_fc.bias"] = tensors["transformer.h.0.mlp.c_fc.bias"] + np.float32(0.5)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})

    def broken(*_):
        (tmp_path / "exports" / "saved_model").mkdir(parents=True)
        (tmp_path / "exports" / "saved_model" / "saved_model.pb").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(export, "write_saved_model", broken)
    record = export.export_formats(model, model_dir, tmp_path / "exports", export.FORMATS, prompts(2, 16, VOCAB))
    safetensors, saved_model = record["formats"]["safetensors"], record["formats"]["saved_model"]
    assert safetensors["passed"] is False and safetensors["max_abs_diff"] > export.PARITY_TOLERANCE
    assert "max |logit diff|" in safetensors["detail"] and "(limit 1e-04)" in safetensors["detail"]
    assert model_dir.is_dir()  # the published model stays; only its promotion is refused
    assert saved_model["passed"] is False and saved_model["detail"] == "export failed: OSError: disk full"
    assert saved_model["files"] == [] and not (tmp_path / "exports" / "saved_model").exists()


def test_a_mirrored_bf16_model_with_resized_embeddings_is_compared_in_float32(tmp_path):
    """A bf16 run on a strategy's variables is compared through a float32 copy of its weights, made outside the
    strategy: here a checkpoint of 300 tokens loaded for a tokenizer of VOCAB (its embedding resized)."""
    import tensorflow as tf

    from trainer.decoders.pretrained import load_pretrained

    small = saved(decoder(300), tmp_path / "base")
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        model = load_pretrained(small, vocab_size=VOCAB, compute_dtype="bfloat16")
    assert model.compute_dtype == tf.bfloat16 and model.weights["transformer.wte.weight"].shape == (VOCAB, 64)
    assert isinstance(model.weights["transformer.wte.weight"], tf.distribute.DistributedValues)
    reference = export.float32_model(model)
    assert reference is not model and reference.compute_dtype == tf.float32
    assert not any(isinstance(weight, tf.distribute.DistributedValues) for weight in reference.weights.values())
    record = export.export_formats(model, saved(model, tmp_path / "model"), tmp_path / "exports", export.FORMATS,
                                   prompts(1, 16, VOCAB))
    assert all(result["passed"] for result in record["formats"].values()), record["formats"]


def test_the_numpy_reader_computes_pytorchs_logits_on_the_golden_checkpoint():
    """The parity reader shares no code with the decoder: on the golden tiny GPT-2 it gives transformers 5 +
    PyTorch's logits, and on its variant attention settings the decoder's."""
    from tests.trainer.decoders.golden import FIXTURES, INPUT_IDS, arrays

    logits = export.safetensors_logits(FIXTURES / "gpt2-tiny", INPUT_IDS)
    difference = float(np.max(np.abs(logits - arrays()["logits"])))
    print(f"numpy reader vs PyTorch on the golden checkpoint: {difference:.2e}")
    assert difference < 1e-5
    sharded = export.safetensors_logits(FIXTURES / "gpt2-tiny-sharded", INPUT_IDS)
    np.testing.assert_array_equal(sharded, logits)


def test_the_numpy_forward_masks_padding_like_pytorchs_gpt2():
    """Keys masked out by attention_mask change nothing for the positions before them, as in PyTorch's GPT-2."""
    model = decoder()
    tensors = {name: variable.numpy() for name, variable in model.weights.items()}
    tokens = prompts(1, 12, VOCAB)
    whole = export.gpt2_logits(tensors, model.config, tokens)
    padded = export.gpt2_logits(tensors, model.config, tokens, attention_mask=np.array([[1] * 8 + [0] * 4]))
    np.testing.assert_allclose(padded[:, :8], whole[:, :8], atol=1e-6)
    np.testing.assert_allclose(whole, export.model_logits(model, tokens), atol=export.PARITY_TOLERANCE)
