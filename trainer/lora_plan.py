"""Which projections LoRA adapts and with what rank, checked against the model's shape without TensorFlow: a run
whose targets the architecture lacks or whose rank exceeds a layer's width is refused before any worker starts.

The model's shape comes from the preset (core.config's MODEL_PRESETS, the tokenizer's vocabulary) or the checkpoint
directory's config.json (trainer.decoders.architectures reads it: two small reads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.config import ConfigError
from trainer.model_shapes import BLOCK_PREFIX, PROJECTIONS, DecoderShape, shape_of

ARCHITECTURE_NAMES = {"gpt2": "GPT-2", "llama": "Llama", "qwen2": "Qwen2"}


@dataclass(frozen=True)
class AdaptedModule:
    """One projection with an adapter: its state-dict path (`transformer.h.0.attn.c_attn`) and features."""

    path: str
    in_features: int
    out_features: int


@dataclass(frozen=True)
class LoraPlan:
    """The adapters of a run: rank r, alpha, the target names, the modules they name, and the weight layout."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    modules: tuple[AdaptedModule, ...]
    fan_in_fan_out: bool

    @property
    def scaling(self) -> float:
        """What the adapters' output is multiplied by (PEFT's `lora_alpha / r`)."""
        return self.alpha / self.rank

    @property
    def parameters(self) -> int:
        """Trainable elements: A [r, in] and B [out, r] per module."""
        return sum(self.rank * (m.in_features + m.out_features) for m in self.modules)


def model_shape(cfg: Any, vocab_size: int) -> DecoderShape:
    """The shape of the model `cfg` trains: a preset's with the tokenizer's vocabulary, or a checkpoint's config.json
    with its embeddings resized to that vocabulary where `resize_embeddings` says so (as the trainer builds it)."""
    from trainer.decoders.architectures import preset_config, read_config

    if cfg.is_preset_model:  # the end token does not change the shape
        return shape_of(preset_config(cfg.model, vocab_size=vocab_size, eos_token_id=0))
    shape = shape_of(read_config(cfg.model))
    return dataclasses.replace(shape, vocab=vocab_size) if cfg.resize_embeddings else shape


def plan_lora(cfg: Any, shape: DecoderShape) -> LoraPlan | None:
    """The adapters `cfg` asks for on a model of `shape` (None without `adapter` = lora); ConfigError naming the
    setting, the module and the architecture's choices when a target is missing or the rank too large."""
    if cfg.adapter != "lora":
        return None
    return lora_plan(shape, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets)


def lora_plan(shape: DecoderShape, *, rank: int, alpha: float, targets: Sequence[str]) -> LoraPlan:
    """`plan_lora` from the settings' values; empty `targets` means all of the architecture's."""
    table = PROJECTIONS[shape.model_type]
    architecture = ARCHITECTURE_NAMES[shape.model_type]
    targets = tuple(targets) or tuple(table)
    missing = [name for name in targets if name not in table]
    if missing:
        raise ConfigError(f"Setting 'lora_targets' names {missing}, which {architecture} lacks: its projections are "
                          f"{', '.join(table)}. Choose among them (empty = all).")
    if rank < 1:
        raise ConfigError(f"Setting 'lora_rank' = {rank} must be at least 1.")
    widths = shape.projection_widths()
    modules = tuple(AdaptedModule(f"{BLOCK_PREFIX[shape.model_type]}.{layer}.{path}", *widths[path])
                    for layer in range(shape.layers) for name in targets for path in table[name])
    narrowest = min(modules, key=lambda m: min(m.in_features, m.out_features))
    width = min(narrowest.in_features, narrowest.out_features)
    if rank > width:
        raise ConfigError(f"Setting 'lora_rank' = {rank} exceeds the width of {narrowest.path} ({narrowest.in_features}"
                          f" in, {narrowest.out_features} out): a rank above {width} adds nothing a full update "
                          f"lacks. Lower 'lora_rank' to {width} or less.")
    return LoraPlan(rank, float(alpha), targets, modules, shape.fan_in_fan_out)


def plan_for_decoder(cfg: Any, decoder_config: Any) -> LoraPlan | None:
    """`plan_lora` for a built decoder's config."""
    return plan_lora(cfg, shape_of(decoder_config))
