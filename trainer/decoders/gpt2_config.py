"""GPT-2's settings as its `config.json` holds them (transformers' GPT2Config, read without transformers), and the
names and shapes of its weights as Hugging Face's PyTorch `GPT2LMHeadModel` state dict has them. No TensorFlow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from core.config import MODEL_PRESETS
from core.document import OpenDocument

ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"
# The tanh approximation of GELU under the names transformers gives it (activations.py): one formula.
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Keys transformers 5's save_pretrained writes for GPT-2 that this decoder does not use (the double-heads model's
# summary, the cache switch), with its defaults; a value read from a base model's config.json wins.
UNUSED_KEYS: dict[str, Any] = {
    "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True, "use_cache": True,
}
# The decoder has no dropout: what it was trained with is what the written config says.
DROPOUT_KEYS = ("attn_pdrop", "embd_pdrop", "resid_pdrop")
# Keys a written config.json sets itself rather than copying from the config read.
WRITTEN_KEYS = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version")


class GPT2ConfigError(ValueError):
    """A GPT-2 config.json whose values this decoder cannot build (the message names the key and the fix)."""


@dataclasses.dataclass(frozen=True)
class GPT2Config(OpenDocument):
    """GPT-2's shape and numerics, with transformers' defaults for the keys a config.json may leave out.

    Attributes:
        vocab_size: rows of the token embedding (and of the tied head).
        n_positions: learned positions: the longest sequence the model reads.
        n_embd, n_layer, n_head: width, blocks and attention heads (n_embd divisible by n_head).
        n_inner: the MLP's hidden width; None means 4 * n_embd.
        activation_function: the MLP's activation, one of TANH_GELU_NAMES.
        layer_norm_epsilon: LayerNorm's epsilon.
        initializer_range: the standard deviation of the random init (and of new embedding rows).
        scale_attn_weights: divide attention scores by sqrt(head width).
        scale_attn_by_inverse_layer_idx: also divide them by (block index + 1).
        reorder_and_upcast_attn: compute attention scores in float32 under mixed precision.
        bos_token_id, eos_token_id, pad_token_id: special tokens, for the generation config.
        tie_word_embeddings: the head shares the token embedding (required).
        add_cross_attention: encoder-decoder use (not supported).
        extra: the config.json keys not modelled here, kept to be written back.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True
    add_cross_attention: bool = False

    DERIVED: ClassVar[frozenset[str]] = frozenset(WRITTEN_KEYS)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            if getattr(self, key) < 1:
                raise GPT2ConfigError(f"'{key}' is {getattr(self, key)}: it must be at least 1.")
        if self.n_embd % self.n_head:
            raise GPT2ConfigError(f"'n_embd' {self.n_embd} is not divisible by 'n_head' {self.n_head}.")
        if self.n_inner is not None and self.n_inner < 1:
            raise GPT2ConfigError(f"'n_inner' is {self.n_inner}: it must be at least 1, or null for 4 * n_embd.")
        if self.activation_function not in TANH_GELU_NAMES:
            raise GPT2ConfigError(f"'activation_function' {self.activation_function!r} is not supported: "
                                  f"use one of {', '.join(TANH_GELU_NAMES)}.")
        if self.layer_norm_epsilon <= 0:
            raise GPT2ConfigError(f"'layer_norm_epsilon' is {self.layer_norm_epsilon}: it must be positive.")
        if not self.tie_word_embeddings:
            raise GPT2ConfigError("'tie_word_embeddings' is false: this decoder's head is always the token "
                                  "embedding (GPT2LMHeadModel ties them).")
        if self.add_cross_attention:
            raise GPT2ConfigError("'add_cross_attention' is true: cross-attention (encoder-decoder) GPT-2 is not "
                                  "supported.")

    @property
    def inner(self) -> int:
        return self.n_inner or 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def head_width(self) -> int:
        """Each attention head's width, under the name every decoder config gives it."""
        return self.head_dim

    def to_json(self) -> dict[str, Any]:
        """config.json as transformers 5's save_pretrained writes it for GPT2LMHeadModel with float32 weights (all
        its keys but `transformers_version`: no transformers wrote it), the keys read and not modelled kept."""
        written = {**UNUSED_KEYS, **super().to_json()}
        written.update({key: 0.0 for key in DROPOUT_KEYS})
        written.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, dtype="float32")
        return dict(sorted(written.items()))

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json as transformers 5 derives it from this config."""
        special = {key: getattr(self, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if getattr(self, key) is not None}
        return {"_from_model_config": True, **special, "output_attentions": False, "output_hidden_states": False,
                "use_cache": True}


def preset_config(preset: str, *, vocab_size: int, eos_token_id: int) -> GPT2Config:
    """The config of a preset of core.config's MODEL_PRESETS (its shape), with the tokenizer's size and end token
    (also the start token, as GPT-2's)."""
    if preset not in MODEL_PRESETS:
        raise GPT2ConfigError(f"no model preset {preset!r}: the presets are {', '.join(MODEL_PRESETS)}.")
    return GPT2Config(**MODEL_PRESETS[preset], vocab_size=vocab_size, bos_token_id=eos_token_id,
                      eos_token_id=eos_token_id)


def parameter_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor PyTorch's GPT2LMHeadModel saves, in its order, with its shape (modeling_gpt2.py): Conv1D
    weights [in, out] and 1-D biases, LayerNorm weight and bias, embeddings [rows, width]. `lm_head.weight` is the
    token embedding (tied) and is not saved; the attention's `bias` / `masked_bias` are buffers, not weights."""
    width, inner = config.n_embd, config.inner
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (config.vocab_size, width), "transformer.wpe.weight": (config.n_positions, width),
    }
    block = {"ln_1.weight": (width,), "ln_1.bias": (width,),
             "attn.c_attn.weight": (width, 3 * width), "attn.c_attn.bias": (3 * width,),
             "attn.c_proj.weight": (width, width), "attn.c_proj.bias": (width,),
             "ln_2.weight": (width,), "ln_2.bias": (width,),
             "mlp.c_fc.weight": (width, inner), "mlp.c_fc.bias": (inner,),
             "mlp.c_proj.weight": (inner, width), "mlp.c_proj.bias": (width,)}
    for layer in range(config.n_layer):
        shapes.update({f"transformer.h.{layer}.{name}": shape for name, shape in block.items()})
    shapes.update({"transformer.ln_f.weight": (width,), "transformer.ln_f.bias": (width,)})
    return shapes


def checkpoint_name(name: str) -> str | None:
    """The state-dict name a checkpoint's tensor `name` stands for, or None for what GPT2LMHeadModel ignores on
    loading: the attention's mask buffers of older checkpoints and the tied head. Checkpoints saved from
    GPT2Model (openai-community/gpt2's) lack the `transformer.` prefix."""
    if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    return name if name.startswith("transformer.") else f"transformer.{name}"
