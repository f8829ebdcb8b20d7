"""Serving exports of the trained model, each proven equal to it before the model may be promoted.

A training output holds:

    model/                  the run's model, a Hugging Face checkpoint written by trainer.decoders' save_pretrained:
                            config.json (its architecture's), model.safetensors in PyTorch's names,
                            generation_config.json and the tokenizer. `AutoModelForCausalLM.from_pretrained` of
                            transformers 5 with PyTorch, vLLM and `trainer.decoders.load_pretrained` load it
                            unchanged: the `safetensors` format
    exports/saved_model/    a TensorFlow SavedModel, signature `serving_default`: int32 `input_ids` and
                            `attention_mask` [batch, tokens] -> float32 `logits` [batch, tokens, vocab]; the tokenizer
                            beside it
    exports/exports.json    written last (the directory is published whole): every format's folder, files and parity

Parity: every format is read back the way its users read it (the checkpoint through a numpy GPT-2 forward on its
tensors and config.json, written here from transformers' PyTorch GPT-2, or a numpy Llama / Qwen2 in export_llama.py,
so that it shares no code with the decoder; the SavedModel through `tf.saved_model.load`) and its logits on fixed
prompts from the validation split are compared with the trained model's, in float32: the largest absolute
difference must be at most PARITY_TOLERANCE and the greedy token at every position identical. A format that fails,
or could not be written, is recorded as failed; the promote task then refuses the run with a gate row naming it
(tasks/promote.py). Nothing here imports TensorFlow at module level.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from core.config.core import EXPORT_FORMATS

log = logging.getLogger("trainer.export")

FORMATS = EXPORT_FORMATS
EXPORTS_FORMAT_VERSION = 2  # 2: the safetensors format is model/ itself, tf_h5 is gone
PARITY_TOLERANCE = 1e-4  # the largest absolute logit difference allowed, float32
PARITY_PROMPTS = 3  # prompts: the openings of the first validation sequences
PARITY_PROMPT_TOKENS = 32
# Where each format lives, relative to the training output (safetensors: the model directory itself).
FORMAT_DIRS = {"safetensors": "model", "saved_model": "exports/saved_model"}
# A checkpoint directory's files that are the model's; the rest (the tokenizer's) are copied beside a SavedModel.
_MODEL_FILES = frozenset({"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"})


class ExportError(RuntimeError):
    """A model cannot be written or read back in a format as promised."""


# ---------------------------------------------------------------------------------------------------------------
# the SavedModel


def write_saved_model(model, tokenizer_dir: Path, target: Path) -> None:
    """A SavedModel of the decoder's forward pass with one serving signature. The decoder attends causally and has
    no padding mask: `attention_mask` is accepted as the signature always has, and must mark a prefix of each row
    (padding on the right only, which never changes the logits of the real tokens before it)."""
    import tensorflow as tf

    def serve(input_ids, attention_mask):
        ones_then_zeros = tf.reduce_all(attention_mask[:, :-1] >= attention_mask[:, 1:])
        within = tf.reduce_all((attention_mask == 0) | (attention_mask == 1))
        check = tf.debugging.Assert(ones_then_zeros & within, [
            "attention_mask must be 1 for the real tokens and 0 for padding on the right only"])
        with tf.control_dependencies([check]):
            return {"logits": tf.cast(model(input_ids), tf.float32)}

    signature = tf.function(serve, input_signature=[
        tf.TensorSpec([None, None], tf.int32, name="input_ids"),
        tf.TensorSpec([None, None], tf.int32, name="attention_mask")])
    module = tf.Module()
    module.model = model  # its variables, which the signature reads
    module.serve = signature
    tf.saved_model.save(module, str(target), signatures={"serving_default": signature.get_concrete_function()})
    copy_tokenizer(tokenizer_dir, target)


def copy_tokenizer(source: Path, target: Path) -> None:
    for path in sorted(source.iterdir()):
        if path.is_file() and path.name not in _MODEL_FILES and not path.name.endswith(".safetensors"):
            shutil.copy2(path, target / path.name)


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


def checkpoint_tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint at `directory`: model.safetensors, or the shards its index lists."""
    from safetensors.numpy import load_file

    from trainer.decoders.safetensors_io import INDEX_FILE, WEIGHTS_FILE

    index = directory / INDEX_FILE
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS_FILE]
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(load_file(str(directory / file)))
    return tensors


def safetensors_logits(directory: Path, tokens: np.ndarray) -> np.ndarray:
    """Read back as a PyTorch user would: the files' tensors and config.json, nothing from the trained model."""
    from trainer.decoders.architectures import read_config
    from trainer.decoders.llama_config import LlamaConfig
    from trainer.export_llama import llama_logits

    config = read_config(str(directory))
    logits = llama_logits if isinstance(config, LlamaConfig) else gpt2_logits
    return logits(checkpoint_tensors(directory), config, tokens)


# ---------------------------------------------------------------------------------------------------------------
# parity


def model_logits(model, tokens: np.ndarray) -> np.ndarray:
    import tensorflow as tf

    return tf.cast(model(tf.constant(tokens, tf.int32)), tf.float32).numpy()


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
    """The trained model as one process computing in float32 sees it: itself, or a float32 decoder holding a copy
    of its weights when it computes in another precision (mixed precision) or its variables are a strategy's
    (several workers). Call outside the strategy's scope, as training does: the copy's variables are plain ones."""
    import tensorflow as tf

    from trainer.decoders.base import zeros_init
    from trainer.decoders.pretrained import build_decoder

    distributed = any(isinstance(weight, tf.distribute.DistributedValues) for weight in model.weights.values())
    if model.compute_dtype == tf.float32 and not distributed:
        return model
    copy = build_decoder(model.config, compute_dtype="float32", initializer=zeros_init)
    for name, variable in copy.weights.items():
        variable.assign(tf.convert_to_tensor(model.weights[name]))
    return copy


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
    """Compare every format of `formats` with the trained model; returns exports.json's content. `model_dir` is a
    local copy of the published model directory (written by save_pretrained: the `safetensors` format, read back
    here, and the tokenizer's files); the SavedModel is written under `target` (a staging directory for
    `exports/`). A format that raises is recorded as failed, with the error: the trained model stays usable, only
    its promotion is refused."""
    reference_model = float32_model(model)
    reference = model_logits(reference_model, prompts)
    writers: dict[str, Callable[[Path], None]] = {
        "safetensors": lambda folder: None,
        "saved_model": lambda folder: write_saved_model(reference_model, model_dir, folder),
    }
    readers: dict[str, Callable[[Path], np.ndarray]] = {
        "safetensors": lambda folder: safetensors_logits(folder, prompts),
        "saved_model": lambda folder: saved_model_logits(folder, prompts),
    }
    record: dict[str, Any] = {
        "format_version": EXPORTS_FORMAT_VERSION, "tolerance": PARITY_TOLERANCE,
        "prompts": {"count": int(prompts.shape[0]), "tokens": int(prompts.shape[1]),
                    "source": "openings of the first validation sequences"},
        "reference": {"dtype": "float32", "max_abs_logit": float(np.max(np.abs(reference)))}, "formats": {},
    }
    for name in formats:
        folder = model_dir if name == "safetensors" else target / name
        started = time.perf_counter()
        try:
            writers[name](folder)
            result = parity(reference, readers[name](folder))
        except Exception as error:  # recorded: the gate names the format and the error
            log.exception("export %s failed", name)
            result = _failed(f"export failed: {type(error).__name__}: {error}")
            if folder != model_dir:  # nothing half-written is published
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
           "gpt2_logits", "parity", "parity_prompts", "safetensors_logits", "validation_prompts", "write_saved_model"]
