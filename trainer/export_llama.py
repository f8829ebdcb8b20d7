"""A numpy Llama / Qwen2 on PyTorch-named tensors (transformers 5's modeling_llama.py and modeling_qwen2.py, eval
mode): how the safetensors export is read back for parity (trainer/export.py), sharing no computation with the
TensorFlow decoder. The rotary frequencies are computed here again, in float64, from the config's rope settings
(transformers' modeling_rope_utils.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * weight


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = np.exp(x - x.max(-1, keepdims=True))
    return shifted / shifted.sum(-1, keepdims=True)


def inverse_frequencies(rope: Mapping, dim: int) -> np.ndarray:
    """Rotary inverse frequencies of the rope types default, linear and llama3."""
    inverse = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    if rope["rope_type"] == "linear":
        return inverse / rope["factor"]
    if rope["rope_type"] != "llama3":
        return inverse
    context, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    wavelength = 2 * math.pi / inverse
    smooth = (context / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * inverse / rope["factor"] + smooth * inverse
    divided = np.where(wavelength > context / low, inverse / rope["factor"], inverse)
    return np.where((wavelength >= context / high) & (wavelength <= context / low), interpolated, divided)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def _linear(x: np.ndarray, tensors: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    out = x @ tensors[name + ".weight"].T
    return out + tensors[name + ".bias"] if name + ".bias" in tensors else out


def llama_logits(tensors: Mapping[str, np.ndarray], config, input_ids: np.ndarray) -> np.ndarray:
    """LlamaForCausalLM's / Qwen2ForCausalLM's logits [batch, tokens, vocab] from its state dict, float32."""
    tensors = {name: np.asarray(value, dtype=np.float32) for name, value in tensors.items()}
    batch, length = input_ids.shape
    heads, kv_heads, dim = config.num_attention_heads, config.kv_heads, config.head_width
    angles = np.arange(length)[:, None] * inverse_frequencies(config.rope, dim)[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    allowed = np.tril(np.ones((length, length), bool))
    x = tensors["model.embed_tokens.weight"][input_ids]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        h = _rms_norm(x, tensors[prefix + "input_layernorm.weight"], config.rms_norm_eps)

        def split(name: str, count: int, h=h, prefix=prefix) -> np.ndarray:
            projected = _linear(h, tensors, prefix + "self_attn." + name)
            return projected.reshape(batch, length, count, dim).transpose(0, 2, 1, 3)

        q, k, v = _rotate(split("q_proj", heads), cos, sin), _rotate(split("k_proj", kv_heads), cos, sin), split(
            "v_proj", kv_heads)
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.where(allowed, q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(dim)), np.finfo(np.float32).min)
        merged = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(batch, length, heads * dim)
        x = x + _linear(merged, tensors, prefix + "self_attn.o_proj")
        h = _rms_norm(x, tensors[prefix + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate = _linear(h, tensors, prefix + "mlp.gate_proj")
        x = x + _linear(gate / (1 + np.exp(-gate)) * _linear(h, tensors, prefix + "mlp.up_proj"), tensors,
                        prefix + "mlp.down_proj")
    x = _rms_norm(x, tensors["model.norm.weight"], config.rms_norm_eps)
    head = tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return (x @ head.T).astype(np.float32)
