"""A decoder's shape read from its config.json fields, for every supported architecture, without TensorFlow: the
projections LoRA may adapt (Hugging Face's module names, their widths and weight layout) and what the memory
forecast counts. GPT-2 keeps Conv1D weights [in, out]; Llama and Qwen2 keep nn.Linear weights [out, in] (PEFT's
`fan_in_fan_out` is true for the first only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# model_type -> LoRA's target names (Hugging Face's module names, as PEFT's target_modules matches them) -> the
# projections of one block they name (GPT-2's `c_proj` is both the attention's output and the MLP's).
_LLAMA = {"q_proj": ("self_attn.q_proj",), "k_proj": ("self_attn.k_proj",), "v_proj": ("self_attn.v_proj",),
          "o_proj": ("self_attn.o_proj",), "gate_proj": ("mlp.gate_proj",), "up_proj": ("mlp.up_proj",),
          "down_proj": ("mlp.down_proj",)}
PROJECTIONS: Mapping[str, Mapping[str, tuple[str, ...]]] = {
    "gpt2": {"c_attn": ("attn.c_attn",), "c_proj": ("attn.c_proj", "mlp.c_proj"), "c_fc": ("mlp.c_fc",)},
    "llama": _LLAMA, "qwen2": _LLAMA,
}
FAN_IN_FAN_OUT = {"gpt2": True, "llama": False, "qwen2": False}  # weights stored [in, out]
BLOCK_PREFIX = {"gpt2": "transformer.h", "llama": "model.layers", "qwen2": "model.layers"}


@dataclass(frozen=True)
class DecoderShape:
    """What sizes a decoder: its widths, heads, blocks and vocabulary, as config.json names them per architecture."""

    model_type: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    positions: int  # learned position rows (GPT-2); 0 for rotary positions
    tied: bool
    biased: frozenset[str]  # the projections (module paths in a block) that have a bias

    @property
    def fan_in_fan_out(self) -> bool:
        return FAN_IN_FAN_OUT[self.model_type]

    def projection_widths(self) -> dict[str, tuple[int, int]]:
        """Module path inside a block -> (in, out) features."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.model_type == "gpt2":
            return {"attn.c_attn": (h, 3 * h), "attn.c_proj": (h, h), "mlp.c_fc": (h, i), "mlp.c_proj": (i, h)}
        return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
                "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}

    def matrix_parameters(self) -> int:
        """Elements of the 2-D weights (embeddings, projections, an untied head)."""
        blocks = self.layers * sum(a * b for a, b in self.projection_widths().values())
        embeddings = (self.vocab + self.positions) * self.hidden
        return blocks + embeddings + (0 if self.tied else self.vocab * self.hidden)

    def vector_parameters(self) -> int:
        """Elements of the 1-D weights: norms and the projections' biases."""
        norms = 2 if self.model_type == "gpt2" else 1  # LayerNorm's weight and bias, RMSNorm's weight
        biases = sum(out for path, (_, out) in self.projection_widths().items() if path in self.biased)
        return self.layers * (2 * norms * self.hidden + biases) + norms * self.hidden


def _int(config: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json's {key!r} = {value!r} is not a positive integer.")
    return value


def decoder_shape(config: Mapping[str, Any]) -> DecoderShape:
    """The shape a config.json's fields describe (gpt2, llama, qwen2); ValueError naming the key otherwise."""
    model_type = config.get("model_type")
    if model_type == "gpt2":
        hidden = _int(config, "n_embd", 768)
        heads = _int(config, "n_head", 12)
        inner = config.get("n_inner") or 4 * hidden
        return DecoderShape("gpt2", hidden, inner, heads, heads, hidden // heads, _int(config, "n_layer", 12),
                            _int(config, "vocab_size", 50257), _int(config, "n_positions", 1024), True,
                            frozenset(("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")))
    if model_type in ("llama", "qwen2"):
        hidden, heads = _int(config, "hidden_size"), _int(config, "num_attention_heads")
        return DecoderShape(
            model_type, hidden, _int(config, "intermediate_size"), heads,
            _int(config, "num_key_value_heads", heads), _int(config, "head_dim", hidden // heads),
            _int(config, "num_hidden_layers"), _int(config, "vocab_size"), 0,
            bool(config.get("tie_word_embeddings", False)), _llama_biases(model_type, config))
    raise ValueError(f"config.json's model_type {model_type!r} is not one of {', '.join(PROJECTIONS)}.")


def _llama_biases(model_type: str, config: Mapping[str, Any]) -> frozenset[str]:
    """Qwen2's q, k and v always; Llama's attention (q, k, v, o) with `attention_bias`, its MLP with `mlp_bias`."""
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    if model_type == "qwen2":
        return frozenset(qkv)
    attention = (*qkv, "self_attn.o_proj") if config.get("attention_bias") else ()
    mlp = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") if config.get("mlp_bias") else ()
    return frozenset((*attention, *mlp))


def shape_of(decoder_config: Any) -> DecoderShape:
    """The shape of a typed decoder config (trainer.decoders' GPT2Config and the like): its config.json fields."""
    return decoder_shape(decoder_config.to_json())
