"""Serving exports of the trained model, each proven equal to it before the model may be promoted.

A training output holds, besides `model/` (transformers 4.57's TF format, kept for resuming and continuing):

    exports/safetensors/    model.safetensors in transformers' PyTorch naming, config.json (GPT2LMHeadModel),
                            generation_config.json and the tokenizer: `AutoModelForCausalLM.from_pretrained` of
                            transformers 5 with PyTorch loads it, written without torch
    exports/saved_model/    a TensorFlow SavedModel, signature `serving_default`: int32 `input_ids` and
                            `attention_mask` [batch, tokens] -> float32 `logits` [batch, tokens, vocab]; the tokenizer
                            beside it
    exports/exports.json    written last (the directory is published whole): every format's folder, files and parity

Each format lives in a folder of its own: a directory holding both `tf_model.h5` and a PyTorch-format
`model.safetensors` makes `TFGPT2LMHeadModel.from_pretrained` pick the safetensors and fail (transformers 4.57.6).

Parity: every export is read back the way its users read it (the safetensors through a numpy GPT-2 forward on its
tensors, written here from transformers' PyTorch GPT-2, since 4.57's TF reader of PyTorch files is the broken path
above; the SavedModel through `tf.saved_model.load`; `tf_model.h5` through `TFGPT2LMHeadModel.from_pretrained`) and
its logits on fixed prompts from the validation split are compared with the trained model's, in float32: the
largest absolute difference must be at most PARITY_TOLERANCE and the greedy token at every position identical.
A format that fails, or could not be written, is recorded as failed; the promote task then refuses the run with a
gate row naming it (tasks/promote.py). Nothing here imports TensorFlow or transformers at module level.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.config.core import EXPORT_FORMATS

log = logging.getLogger("trainer.export")

FORMATS = EXPORT_FORMATS
EXPORTS_FORMAT_VERSION = 1
PARITY_TOLERANCE = 1e-4  # the largest absolute logit difference allowed, float32
PARITY_PROMPTS = 3  # prompts: the openings of the first validation sequences
PARITY_PROMPT_TOKENS = 32
SAFETENSORS_FILE = "model.safetensors"
# Files of a TF save_pretrained directory that are the model's, not its tokenizer's.
_MODEL_FILES = frozenset({"tf_model.h5", "config.json", "generation_config.json"})
# Where each format lives, relative to the training output (tf_h5: the save_pretrained directory itself).
FORMAT_DIRS = {"safetensors": "exports/safetensors", "saved_model": "exports/saved_model", "tf_h5": "model"}


class ExportError(RuntimeError):
    """A model cannot be written in a format as promised (a weight name or shape PyTorch's GPT-2 does not have)."""


# ---------------------------------------------------------------------------------------------------------------
# the PyTorch naming


def pytorch_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' PyTorch `GPT2LMHeadModel` saves, with its shape (modeling_gpt2.py): Conv1D keeps
    TensorFlow's [in, out] weight layout and a 1-D bias; LayerNorm has weight and bias; the embeddings [rows, width].
    `lm_head.weight` is not saved: it is tied to `transformer.wte.weight` (`_tied_weights_keys`), and PyTorch's
    `save_pretrained` drops tied copies. The attention's `bias`/`masked_bias` are non-persistent buffers."""
    width, inner = config.n_embd, config.n_inner or 4 * config.n_embd
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (config.vocab_size, width), "transformer.wpe.weight": (config.n_positions, width),
        "transformer.ln_f.weight": (width,), "transformer.ln_f.bias": (width,),
    }
    conv1d = {"attn.c_attn": (width, 3 * width), "attn.c_proj": (width, width), "mlp.c_fc": (width, inner),
              "mlp.c_proj": (inner, width)}
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}."
        for norm in ("ln_1", "ln_2"):
            shapes[f"{prefix}{norm}.weight"] = shapes[f"{prefix}{norm}.bias"] = (width,)
        for name, (fan_in, fan_out) in conv1d.items():
            shapes[f"{prefix}{name}.weight"] = (fan_in, fan_out)
            shapes[f"{prefix}{name}.bias"] = (fan_out,)
    return shapes


def pytorch_state_dict(model) -> dict[str, np.ndarray]:
    """The TF model's weights under PyTorch's names, in PyTorch's shapes, float32: the names from transformers' own
    TF-to-PyTorch conversion (the one `load_tf2_weights_in_pytorch_model` uses), the layout from its
    `apply_transpose` (GPT-2 transposes nothing; Conv1D biases lose TF's leading axis of 1)."""
    from transformers.modeling_tf_pytorch_utils import apply_transpose, convert_tf_weight_name_to_pt_weight_name

    if not getattr(model.config, "tie_word_embeddings", True):
        raise ExportError("the model's lm_head is not tied to its embeddings: GPT-2's TF model always ties them.")
    expected = pytorch_shapes(model.config)
    tensors: dict[str, np.ndarray] = {}
    for weight in model.weights:
        name, transpose = convert_tf_weight_name_to_pt_weight_name(weight.name, tf_weight_shape=weight.shape)
        if name not in expected:
            raise ExportError(f"TF weight {weight.name} becomes {name!r}, which PyTorch's GPT2LMHeadModel lacks.")
        array = np.asarray(weight.numpy(), dtype=np.float32)
        tensors[name] = np.ascontiguousarray(apply_transpose(transpose, array, expected[name], pt_to_tf=False))
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ExportError(f"the TF model has no weights for {missing[:5]} ({len(missing)} PyTorch tensors).")
    wrong = [f"{name} {tensors[name].shape} != {shape}" for name, shape in expected.items()
             if tensors[name].shape != shape]
    if wrong:
        raise ExportError(f"shapes differ from PyTorch's GPT-2: {wrong[:5]}")
    return tensors


def write_safetensors(model, tokenizer_dir: Path, target: Path) -> list[Path]:
    """model.safetensors (metadata format 'pt', as PyTorch's save_pretrained writes), config.json naming
    GPT2LMHeadModel, generation_config.json and the tokenizer files: a transformers 5 PyTorch directory."""
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    target.mkdir(parents=True, exist_ok=True)
    save_file(pytorch_state_dict(model), str(target / SAFETENSORS_FILE), metadata={"format": "pt"})
    config = model.config.to_diff_dict()  # what save_pretrained writes: the settings that differ from defaults
    config.update(architectures=["GPT2LMHeadModel"], dtype="float32", tie_word_embeddings=True)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig.from_model_config(model.config).save_pretrained(str(target))
    copy_tokenizer(tokenizer_dir, target)
    return sorted(path for path in target.rglob("*") if path.is_file())


def copy_tokenizer(source: Path, target: Path) -> None:
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in _MODEL_FILES:
            shutil.copy2(path, target / path.name)


# ---------------------------------------------------------------------------------------------------------------
# the SavedModel


def write_saved_model(model, tokenizer_dir: Path, target: Path) -> None:
    """A SavedModel of the model's forward pass only (no Keras metadata), with one serving signature."""
    import tensorflow as tf

    def serve(input_ids, attention_mask):
        output = model(input_ids=input_ids, attention_mask=attention_mask, training=False, use_cache=False,
                       return_dict=True)
        return {"logits": tf.cast(output.logits, tf.float32)}

    signature = tf.function(serve, input_signature=[
        tf.TensorSpec([None, None], tf.int32, name="input_ids"),
        tf.TensorSpec([None, None], tf.int32, name="attention_mask")])
    module = tf.Module()
    module.weights = list(model.weights)  # what the signature reads; the Keras model itself is not saved
    module.serve = signature
    tf.saved_model.save(module, str(target), signatures={"serving_default": signature.get_concrete_function()})
    copy_tokenizer(tokenizer_dir, target)


def saved_model_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    serving = tf.saved_model.load(str(directory)).signatures["serving_default"]
    ids = tf.constant(tokens, tf.int32)
    return serving(input_ids=ids, attention_mask=tf.ones_like(ids))["logits"].numpy()


# ---------------------------------------------------------------------------------------------------------------
# a numpy GPT-2, on PyTorch-named tensors (transformers' modeling_gpt2.py, eval mode)


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + np.float32(eps)) * weight + bias


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x ** 3)))


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "gelu_fast": _gelu_tanh,
    "relu": lambda x: np.maximum(x, 0),
}


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def _attention(h: np.ndarray, tensors: Mapping[str, np.ndarray], prefix: str, config, layer: int,
               allowed: np.ndarray) -> np.ndarray:
    batch, length, width = h.shape
    heads = config.n_head
    qkv = h @ tensors[prefix + "attn.c_attn.weight"] + tensors[prefix + "attn.c_attn.bias"]
    q, k, v = (part.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3)
               for part in np.split(qkv, 3, axis=-1))
    scores = q @ k.transpose(0, 1, 3, 2)
    if config.scale_attn_weights:
        scores = scores / np.float32(np.sqrt(width // heads))
    if config.scale_attn_by_inverse_layer_idx:
        scores = scores / np.float32(layer + 1)
    scores = np.where(allowed, scores, np.finfo(np.float32).min)
    merged = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(batch, length, width)
    return merged @ tensors[prefix + "attn.c_proj.weight"] + tensors[prefix + "attn.c_proj.bias"]


def gpt2_logits(tensors: Mapping[str, np.ndarray], config, input_ids: np.ndarray,
                attention_mask: np.ndarray | None = None) -> np.ndarray:
    """GPT2LMHeadModel's logits [batch, tokens, vocab] from its PyTorch state dict, in float32: x @ W + b for
    Conv1D ([in, out] weights), pre-LayerNorm blocks, causal attention, and the head tied to `transformer.wte`."""
    activation = ACTIVATIONS.get(config.activation_function)
    if activation is None:
        raise ExportError(f"the numpy GPT-2 has no activation {config.activation_function!r}")
    tensors = {name: np.asarray(value, dtype=np.float32) for name, value in tensors.items()}
    batch, length = input_ids.shape
    mask = np.ones((batch, length), bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    allowed = np.tril(np.ones((length, length), bool))[None, None] & mask[:, None, None, :]
    x = tensors["transformer.wte.weight"][input_ids] + tensors["transformer.wpe.weight"][np.arange(length)]
    eps = config.layer_norm_epsilon
    for layer in range(config.n_layer):
        prefix = f"transformer.h.{layer}."
        h = _layer_norm(x, tensors[prefix + "ln_1.weight"], tensors[prefix + "ln_1.bias"], eps)
        x = x + _attention(h, tensors, prefix, config, layer, allowed)
        h = _layer_norm(x, tensors[prefix + "ln_2.weight"], tensors[prefix + "ln_2.bias"], eps)
        h = activation(h @ tensors[prefix + "mlp.c_fc.weight"] + tensors[prefix + "mlp.c_fc.bias"])
        x = x + h @ tensors[prefix + "mlp.c_proj.weight"] + tensors[prefix + "mlp.c_proj.bias"]
    x = _layer_norm(x, tensors["transformer.ln_f.weight"], tensors["transformer.ln_f.bias"], eps)
    return x @ tensors["transformer.wte.weight"].T


def safetensors_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    """Read back as a PyTorch user would: the file's tensors and config.json, nothing from the TF model."""
    from safetensors.numpy import load_file
    from transformers import GPT2Config

    config = GPT2Config.from_pretrained(str(directory))
    return gpt2_logits(load_file(str(directory / SAFETENSORS_FILE)), config, tokens)


def tf_h5_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    from transformers import TFGPT2LMHeadModel

    with float32_policy():  # use_safetensors=False: the TF weights on purpose, whatever else the directory holds
        model = TFGPT2LMHeadModel.from_pretrained(str(directory), use_safetensors=False)
    return model_logits(model, tokens)


# ---------------------------------------------------------------------------------------------------------------
# parity


def model_logits(model, tokens: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    ids = tf.constant(tokens, tf.int32)
    output = model(input_ids=ids, attention_mask=tf.ones_like(ids), training=False, use_cache=False, return_dict=True)
    return tf.cast(output.logits, tf.float32).numpy()


def parity(reference: np.ndarray, logits: np.ndarray, tolerance: float = PARITY_TOLERANCE) -> dict[str, Any]:
    """How far an export's logits are from the trained model's: the largest absolute difference, and whether the
    greedy (argmax) token is the same at every position."""
    if logits.shape != reference.shape:
        return {"passed": False, "max_abs_diff": None, "greedy_identical": False, "tolerance": tolerance,
                "detail": f"logits of shape {list(logits.shape)}, the trained model's {list(reference.shape)}"}
    diff = float(np.max(np.abs(logits.astype(np.float64) - reference.astype(np.float64))))
    same = int(np.sum(logits.argmax(-1) == reference.argmax(-1)))
    positions = int(np.prod(reference.shape[:-1]))
    passed = bool(np.isfinite(diff) and diff <= tolerance and same == positions)
    return {"passed": passed, "max_abs_diff": diff, "greedy_identical": same == positions, "tolerance": tolerance,
            "detail": f"max |logit diff| {diff:.2e} (limit {tolerance:.0e}), greedy tokens {same}/{positions} same"}


def float32_model(model):
    """The trained model as one process computing in float32 sees it: itself, or a float32 copy of its weights when
    it computes in another precision (mixed precision) or its variables are a strategy's (several workers)."""
    import tensorflow as tf

    distributed = any(isinstance(weight, tf.distribute.DistributedValues) for weight in model.weights)
    if getattr(model, "compute_dtype", "float32") == "float32" and not distributed:
        return model
    from transformers import TFGPT2LMHeadModel

    with float32_policy():
        copy = TFGPT2LMHeadModel(model.config)
        copy.build_in_name_scope()
    # By name, not by order: resize_token_embeddings moves the embeddings to the end of a model's weights.
    source = {_unscoped(weight.name): weight for weight in model.weights}
    for weight in copy.weights:
        weight.assign(np.asarray(source[_unscoped(weight.name)].numpy(), dtype=np.float32))
    return copy


def _unscoped(name: str) -> str:
    """A variable's name without the model's own scope (`tfgpt2lm_head_model_1/`), which differs between models."""
    return name.split("/", 1)[-1]


@contextlib.contextmanager
def float32_policy() -> Iterator[None]:
    """Keras layers built inside compute in float32, whatever the run's precision policy."""
    import tf_keras

    policy = tf_keras.mixed_precision.global_policy()
    tf_keras.mixed_precision.set_global_policy("float32")
    try:
        yield
    finally:
        tf_keras.mixed_precision.set_global_policy(policy)


def parity_prompts(sequences: np.ndarray, count: int = PARITY_PROMPTS,
                   tokens: int = PARITY_PROMPT_TOKENS) -> np.ndarray:
    """The openings of the first `count` sequences (fewer when there are fewer), int32 [count, tokens]."""
    if len(sequences) == 0:
        raise ExportError("no sequences to take parity prompts from")
    return np.asarray(sequences[:count, :tokens], dtype=np.int32)


def validation_prompts(manifest_url: str, manifest: Mapping[str, Any]) -> np.ndarray:
    """The parity prompts of a dataset: the openings of its first validation sequences (of the training split when
    the validation split has none)."""
    from trainer.eval_sample import leading_records

    block = manifest["block_size"]
    for split in ("validation", "train"):
        if manifest["splits"][split]["sequences"]:
            records, _ = leading_records(manifest_url, dict(manifest), split, PARITY_PROMPTS * block)
            return parity_prompts(np.concatenate(records).reshape(-1, block))
    raise ExportError(f"{manifest_url} has no sequences to take parity prompts from")


def export_formats(model, model_dir: Path, target: Path, formats: Sequence[str],
                   prompts: np.ndarray) -> dict[str, Any]:
    """Write every format of `formats` but tf_h5 under `target` (a staging directory for `exports/`), read each back
    and compare it with the trained model; returns exports.json's content. `model_dir` is the published (or
    staged) save_pretrained directory: the tokenizer's files and the tf_model.h5 read back. A format that raises
    is recorded as failed, with the error: the trained model stays usable, only its promotion is refused."""
    reference_model = float32_model(model)
    reference = model_logits(reference_model, prompts)
    writers: dict[str, Callable[[Path], None]] = {
        "safetensors": lambda folder: write_safetensors(reference_model, model_dir, folder),
        "saved_model": lambda folder: write_saved_model(reference_model, model_dir, folder),
        "tf_h5": lambda folder: None,
    }
    readers: dict[str, Callable[[Path], np.ndarray]] = {
        "safetensors": lambda folder: safetensors_logits(folder, prompts),
        "saved_model": lambda folder: saved_model_logits(folder, prompts),
        "tf_h5": lambda folder: tf_h5_logits(folder, prompts),
    }
    record: dict[str, Any] = {
        "format_version": EXPORTS_FORMAT_VERSION, "tolerance": PARITY_TOLERANCE,
        "prompts": {"count": int(prompts.shape[0]), "tokens": int(prompts.shape[1]),
                    "source": "openings of the first validation sequences"},
        "reference": {"dtype": "float32", "max_abs_logit": float(np.max(np.abs(reference)))}, "formats": {},
    }
    for name in formats:
        folder = model_dir if name == "tf_h5" else target / name
        started = time.perf_counter()
        try:
            writers[name](folder)
            result = parity(reference, readers[name](folder))
        except Exception as error:  # recorded: the gate names the format and the error
            log.exception("export %s failed", name)
            result = _failed(f"export failed: {type(error).__name__}: {error}")
            if name != "tf_h5":  # nothing half-written is published
                shutil.rmtree(folder, ignore_errors=True)
        record["formats"][name] = {**result, "files": _files(folder) if folder.is_dir() else [],
                                   "dir": FORMAT_DIRS[name], "seconds": round(time.perf_counter() - started, 3)}
        result = record["formats"][name]
        log.info("export %s: %s (%s)", name, "parity passed" if result["passed"] else "FAILED", result["detail"])
    return record


def failed_record(formats: Sequence[str], detail: str) -> dict[str, Any]:
    """exports.json when nothing could be compared: every format failed, for `detail`."""
    return {"format_version": EXPORTS_FORMAT_VERSION, "tolerance": PARITY_TOLERANCE, "prompts": None,
            "reference": None, "formats": {name: {**_failed(detail), "files": [], "dir": FORMAT_DIRS[name],
                                                  "seconds": 0.0} for name in formats}}


def _failed(detail: str) -> dict[str, Any]:
    return {"passed": False, "max_abs_diff": None, "greedy_identical": False, "tolerance": PARITY_TOLERANCE,
            "detail": detail}


def _files(folder: Path) -> list[dict[str, Any]]:
    return [{"name": path.relative_to(folder).as_posix(), "bytes": path.stat().st_size}
            for path in sorted(folder.rglob("*")) if path.is_file()]


__all__ = ["EXPORTS_FORMAT_VERSION", "FORMATS", "FORMAT_DIRS", "PARITY_TOLERANCE", "ExportError", "export_formats",
           "gpt2_logits", "parity", "parity_prompts", "pytorch_shapes", "pytorch_state_dict", "validation_prompts",
           "write_safetensors", "write_saved_model"]
