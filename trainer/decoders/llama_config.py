"""Llama's and Qwen2's settings as their `config.json` holds them (transformers' LlamaConfig / Qwen2Config, read
without transformers), the names and shapes of their weights as Hugging Face's PyTorch `LlamaForCausalLM` /
`Qwen2ForCausalLM` state dicts have them, and the rotary frequencies. No TensorFlow.

Both are one decoder: pre-RMSNorm blocks, rotary positions, grouped-query attention, a SwiGLU MLP and nn.Linear
weights laid out [out, in]. Qwen2 differs in its q/k/v biases (always on, no output bias) and an optional sliding
window. A config.json may carry the rotary settings as transformers 4 wrote them (`rope_theta`, `rope_scaling`)
or as transformers 5 does (`rope_parameters`); one is written back, transformers 5's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import numpy as np

from core.config import MODEL_PRESETS
from core.document import OpenDocument

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
ROPE_KEYS = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
DEFAULT_ROPE_THETA = 10000.0
# Keys a written config.json sets itself rather than copying from the config read.
WRITTEN_KEYS = ("architectures", "dtype", "torch_dtype", "transformers_version")
# The keys transformers 5's save_pretrained writes for each model type (besides the written ones).
_COMMON_KEYS = ("attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
                "intermediate_size", "max_position_embeddings", "model_type", "num_attention_heads",
                "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps", "rope_parameters",
                "tie_word_embeddings", "use_cache", "vocab_size")
TYPE_KEYS = {"llama": _COMMON_KEYS + ("attention_bias", "head_dim", "mlp_bias", "pretraining_tp"),
             "qwen2": _COMMON_KEYS + ("layer_types", "max_window_layers", "sliding_window", "use_sliding_window")}
SLIDING = "sliding_attention"


class LlamaConfigError(ValueError):
    """A Llama / Qwen2 config.json whose values this decoder cannot build (the message names the key and the fix)."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig(OpenDocument):
    """Llama's (and Qwen2's) shape and numerics, with transformers' defaults for the keys a config.json may omit.

    Attributes:
        model_type: `llama` or `qwen2` (Qwen2: q/k/v biases, no output bias, an optional sliding window).
        vocab_size, hidden_size, intermediate_size, num_hidden_layers: the shape; intermediate_size is SwiGLU's.
        num_attention_heads, num_key_value_heads: query heads and key/value heads (grouped-query attention: the
            first a multiple of the second; None means as many as the query heads).
        head_dim: each head's width; None means hidden_size / num_attention_heads.
        hidden_act: the MLP's gate activation (SiLU: SwiGLU).
        max_position_embeddings: the longest sequence the rotary settings were made for.
        rms_norm_eps: RMSNorm's epsilon.
        rope_theta, rope_scaling: transformers 4's rotary keys; rope_parameters: transformers 5's (both theta and
            type). Types default, linear and llama3.
        attention_bias, mlp_bias: Llama's optional biases on q/k/v/o and on the MLP's three projections.
        use_sliding_window, sliding_window, max_window_layers, layer_types: Qwen2's sliding-window attention.
        tie_word_embeddings: the head is the token embedding (else `lm_head.weight` of its own).
        extra: the config.json keys not modelled here, kept to be written back.
    """

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False

    DERIVED: ClassVar[frozenset[str]] = frozenset(WRITTEN_KEYS)

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise LlamaConfigError(f"'model_type' {self.model_type!r} is not one of {', '.join(ARCHITECTURES)}.")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings"):
            if getattr(self, key) < 1:
                raise LlamaConfigError(f"'{key}' is {getattr(self, key)}: it must be at least 1.")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise LlamaConfigError(f"'hidden_size' {self.hidden_size} is not divisible by 'num_attention_heads' "
                                   f"{self.num_attention_heads}: fix the head count (or set 'head_dim').")
        if self.kv_heads < 1 or self.num_attention_heads % self.kv_heads:
            raise LlamaConfigError(f"'num_attention_heads' {self.num_attention_heads} is not a multiple of "
                                   f"'num_key_value_heads' {self.kv_heads}: grouped-query attention shares each "
                                   "key/value head among a whole number of query heads.")
        if self.hidden_act != "silu":
            raise LlamaConfigError(f"'hidden_act' {self.hidden_act!r} is not supported: the decoder's MLP is SwiGLU "
                                   "(silu).")
        if self.rms_norm_eps <= 0:
            raise LlamaConfigError(f"'rms_norm_eps' is {self.rms_norm_eps}: it must be positive.")
        _ = self.rope  # refuses rotary settings the decoder cannot compute
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise LlamaConfigError(f"'layer_types' lists {len(self.layer_types)} layers, the model has "
                                   f"{self.num_hidden_layers}.")
        if self.sliding_layers and not (self.sliding_window and self.sliding_window > 0):
            raise LlamaConfigError(f"sliding-window attention is on but 'sliding_window' is {self.sliding_window!r}: "
                                   "set it to the window's length in tokens.")

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.model_type]

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    @property
    def head_width(self) -> int:
        """Each attention head's width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """The layers that attend within `sliding_window` tokens only (Qwen2's rule in transformers 5)."""
        if self.model_type != "qwen2":
            return ()
        if self.layer_types is not None:
            return tuple(layer for layer, kind in enumerate(self.layer_types) if kind == SLIDING)
        if not self.use_sliding_window:
            return ()
        return tuple(range(self.max_window_layers, self.num_hidden_layers))

    # The names the GPT-2 config gives the shape, which the trainer, evaluation and exports read.
    @property
    def n_layer(self) -> int:
        return self.num_hidden_layers

    @property
    def n_head(self) -> int:
        return self.num_attention_heads

    @property
    def n_embd(self) -> int:
        return self.hidden_size

    @property
    def n_positions(self) -> int:
        """The longest sequence computed as the checkpoint would: its positions, or a shorter sliding window (within
        it, sliding attention is full causal attention)."""
        if self.sliding_layers:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def rope(self) -> dict[str, Any]:
        """The rotary settings as transformers 5 writes them (`rope_parameters`), from either generation's keys."""
        if self.rope_parameters is not None:
            found = dict(self.rope_parameters)
        else:
            found = dict(self.rope_scaling or {})
            if "type" in found and "rope_type" not in found:
                found["rope_type"] = found.pop("type")
            found.setdefault("rope_theta", DEFAULT_ROPE_THETA if self.rope_theta is None else self.rope_theta)
        found.setdefault("rope_type", "default")
        found.setdefault("rope_theta", DEFAULT_ROPE_THETA)
        kind = found["rope_type"]
        if kind not in ROPE_TYPES:
            raise LlamaConfigError(f"rope_scaling type {kind!r} is not supported: the decoder computes rotary "
                                   f"positions of type {', '.join(ROPE_TYPES)}. Use a checkpoint with one of them.")
        missing = [key for key in ROPE_KEYS[kind] if not isinstance(found.get(key), (int, float))]
        if missing or not isinstance(found["rope_theta"], (int, float)) or found["rope_theta"] <= 0:
            raise LlamaConfigError(f"rope_scaling of type {kind!r} needs a positive rope_theta and numbers for "
                                   f"{', '.join(ROPE_KEYS[kind]) or 'nothing else'}; it holds {found}.")
        return found

    def to_json(self) -> dict[str, Any]:
        """config.json as transformers 5's save_pretrained writes it for this architecture with float32 weights
        (all its keys but `transformers_version`), the keys read and not modelled kept."""
        own = {field.name for field in dataclasses.fields(self)} - {"extra"}
        written = {key: value for key, value in super().to_json().items()
                   if key not in own or key in TYPE_KEYS[self.model_type]}
        written.update(rope_parameters=self.rope, num_key_value_heads=self.kv_heads, attention_dropout=0.0,
                       architectures=[self.architecture], dtype="float32", use_cache=written.get("use_cache", True))
        if self.model_type == "llama":
            written.update(head_dim=self.head_width, pretraining_tp=written.get("pretraining_tp", 1))
        else:
            written["layer_types"] = ["sliding_attention" if layer in self.sliding_layers else "full_attention"
                                      for layer in range(self.num_hidden_layers)]
        return dict(sorted(written.items()))

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json as transformers 5 derives it from this config."""
        special = {key: getattr(self, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if getattr(self, key) is not None}
        if isinstance(special.get("eos_token_id"), tuple):
            special["eos_token_id"] = list(special["eos_token_id"])
        return {"_from_model_config": True, **special, "output_attentions": False, "output_hidden_states": False,
                "use_cache": True}


def inverse_frequencies(config: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies [head_dim / 2], float32, as transformers 5 computes them for the config's
    rope type (modeling_rope_utils.py: default, linear, llama3)."""
    rope = config.rope
    dim = config.head_width
    inverse = (1.0 / (np.float32(rope["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    inverse = inverse.astype(np.float32)
    if rope["rope_type"] == "linear":
        return (inverse / np.float32(rope["factor"])).astype(np.float32)
    if rope["rope_type"] == "llama3":
        return _llama3(inverse, rope)
    return inverse


def _llama3(inverse: np.ndarray, rope: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's rescaling: long wavelengths divided by `factor`, short ones kept, those between interpolated."""
    factor, low, high = (np.float32(rope[key]) for key in ("factor", "low_freq_factor", "high_freq_factor"))
    context = np.float32(rope["original_max_position_embeddings"])
    low_wavelength, high_wavelength = context / low, context / high
    wavelength = np.float32(2 * math.pi) / inverse
    scaled = np.where(wavelength > low_wavelength, inverse / factor, inverse)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) & ~(wavelength > low_wavelength)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def preset_config(preset: str, *, vocab_size: int, eos_token_id: int) -> LlamaConfig:
    """The config of a Llama-architecture preset of core.config's MODEL_PRESETS, with the tokenizer's size and end
    token (also the start token, as the project's BPE has no other)."""
    shape = dict(MODEL_PRESETS[preset])
    return LlamaConfig(**shape, vocab_size=vocab_size, bos_token_id=eos_token_id, eos_token_id=eos_token_id)


def parameter_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor PyTorch's LlamaForCausalLM / Qwen2ForCausalLM saves, in its order, with its shape: nn.Linear
    weights [out, in], biases where the config has them, RMSNorm weights, the embedding [rows, width], and
    `lm_head.weight` when the head is not tied (a tied head is not saved)."""
    width, inner, heads = config.hidden_size, config.intermediate_size, config.head_width
    qwen2 = config.model_type == "qwen2"
    attention = {"q_proj": config.num_attention_heads * heads, "k_proj": config.kv_heads * heads,
                 "v_proj": config.kv_heads * heads}
    block: dict[str, tuple[int, ...]] = {}
    for name, rows in attention.items():
        block[f"self_attn.{name}.weight"] = (rows, width)
        if qwen2 or config.attention_bias:
            block[f"self_attn.{name}.bias"] = (rows,)
    block["self_attn.o_proj.weight"] = (width, config.num_attention_heads * heads)
    if config.attention_bias and not qwen2:
        block["self_attn.o_proj.bias"] = (width,)
    for name, shape in (("gate_proj", (inner, width)), ("up_proj", (inner, width)), ("down_proj", (width, inner))):
        block[f"mlp.{name}.weight"] = shape
        if config.mlp_bias and not qwen2:
            block[f"mlp.{name}.bias"] = (shape[0],)
    block.update({"input_layernorm.weight": (width,), "post_attention_layernorm.weight": (width,)})
    shapes = {"model.embed_tokens.weight": (config.vocab_size, width)}
    for layer in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in block.items()})
    shapes["model.norm.weight"] = (width,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, width)
    return shapes


def checkpoint_name(config: LlamaConfig, name: str) -> str | None:
    """The state-dict name a checkpoint's tensor `name` stands for, or None for what transformers ignores on
    loading: a tied head saved anyway, and the rotary buffers of older checkpoints."""
    if name.endswith(".rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings):
        return None
    return name
