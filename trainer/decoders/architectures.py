"""Which Hugging Face architectures the decoders read, and a checkpoint's config.json read and checked by them.

Nothing here imports TensorFlow: a checkpoint's config is refused (another architecture, a value the decoder
cannot build, a block size beyond its positions) before anything expensive starts.
"""

from __future__ import annotations

from typing import Any

from core import storage
from core.config import MODEL_PRESETS
from core.document import DocumentError
from trainer.decoders import gpt2_config, llama_config
from trainer.decoders.gpt2_config import GPT2Config, GPT2ConfigError
from trainer.decoders.llama_config import LlamaConfig, LlamaConfigError

CONFIG_FILE = "config.json"
DecoderConfig = GPT2Config | LlamaConfig
# `architectures[0]` of a config.json -> its config type; a config without `architectures` is read by model_type.
CONFIG_TYPES: dict[str, type[DecoderConfig]] = {
    gpt2_config.ARCHITECTURE: GPT2Config, **dict.fromkeys(llama_config.ARCHITECTURES.values(), LlamaConfig)}
MODEL_TYPES = {gpt2_config.MODEL_TYPE: gpt2_config.ARCHITECTURE, **llama_config.ARCHITECTURES}
SUPPORTED = tuple(CONFIG_TYPES)


class CheckpointError(ValueError):
    """A Hugging Face checkpoint directory this project cannot read or write as it is; the message names the file,
    the tensor or the key, and what to change."""


def architecture_of(value: Any, source: str) -> str:
    """The supported architecture a config.json names (`architectures`, else `model_type`); CheckpointError naming
    what it holds and the supported list otherwise."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{source}: expected a JSON object, got {type(value).__name__}.")
    named = value.get("architectures")
    if named is not None:
        if not isinstance(named, list) or len(named) != 1 or named[0] not in CONFIG_TYPES:
            raise CheckpointError(f"{source}: architectures {named!r} is not supported: the supported "
                                  f"architectures are {', '.join(SUPPORTED)}. Use a checkpoint of one of them.")
        return named[0]
    model_type = value.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{source}: model_type {model_type!r} (no architectures key) is not supported: the "
                              f"supported architectures are {', '.join(SUPPORTED)}. Use a checkpoint of one of them.")
    return MODEL_TYPES[model_type]


def config_from_json(value: Any, source: str) -> DecoderConfig:
    """The typed config a config.json's content describes; CheckpointError naming `source` and the key otherwise."""
    architecture = architecture_of(value, source)
    config_type = CONFIG_TYPES[architecture]
    expected_type = {name: kind for kind, name in llama_config.ARCHITECTURES.items()}.get(architecture)
    if expected_type is not None:
        if value.get("model_type", expected_type) != expected_type:
            raise CheckpointError(f"{source}: architectures names {architecture} but model_type is "
                                  f"{value.get('model_type')!r}: fix {CONFIG_FILE} (model_type {expected_type!r}).")
        value = {**value, "model_type": expected_type}
    try:
        return config_type.from_json(value, source)
    except DocumentError as error:
        raise CheckpointError(f"{error} Fix {CONFIG_FILE} or use another checkpoint.") from None
    except (GPT2ConfigError, LlamaConfigError) as error:
        raise CheckpointError(f"{source}: {error}") from None


def read_config(directory: str) -> DecoderConfig:
    """The config.json of the checkpoint directory `directory` (a path or URL), read and checked."""
    url = storage.join(directory, CONFIG_FILE)
    try:
        value = storage.read_json(url)
    except FileNotFoundError:
        raise CheckpointError(f"{url} is missing: {directory} is not a Hugging Face checkpoint directory "
                              "(save_pretrained writes config.json beside the weights).") from None
    except ValueError as error:
        raise CheckpointError(f"{url} is not JSON ({error}).") from None
    return config_from_json(value, url)


def preset_config(preset: str, *, vocab_size: int, eos_token_id: int) -> DecoderConfig:
    """The config of a core.config MODEL_PRESETS preset, in its architecture's family, with the tokenizer's size and
    end token."""
    llama = MODEL_PRESETS.get(preset, {}).get("model_type") in llama_config.ARCHITECTURES
    family = llama_config if llama else gpt2_config
    return family.preset_config(preset, vocab_size=vocab_size, eos_token_id=eos_token_id)


def parameter_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the config's architecture saves, in PyTorch's order, with its shape."""
    if isinstance(config, LlamaConfig):
        return llama_config.parameter_shapes(config)
    return gpt2_config.parameter_shapes(config)


def checkpoint_name(config: DecoderConfig, name: str) -> str | None:
    """The model's weight a checkpoint's tensor `name` stands for; None for one the architecture ignores."""
    if isinstance(config, LlamaConfig):
        return llama_config.checkpoint_name(config, name)
    return gpt2_config.checkpoint_name(name)


def embedding_names(config: DecoderConfig) -> tuple[str, ...]:
    """The weights with a row per token: resized together when the tokenizer's vocabulary differs."""
    if isinstance(config, GPT2Config):
        return ("transformer.wte.weight",)
    return ("model.embed_tokens.weight",) + (() if config.tie_word_embeddings else ("lm_head.weight",))


def check_block_size(config: DecoderConfig, block_size: int, source: str) -> None:
    """Refuse a block size beyond the model's positions, or beyond a sliding window (Qwen2's), which would make
    attention the checkpoint's sliding one rather than the causal one the decoder computes."""
    window = config.sliding_window if isinstance(config, LlamaConfig) and config.sliding_layers else None
    if window is not None and block_size > window:
        raise CheckpointError(f"block_size {block_size} is longer than the sliding window of model {source} "
                              f"(use_sliding_window, sliding_window {window}, layers {list(config.sliding_layers)}): "
                              f"lower 'block_size' in the run config to {window} or less.")
    if block_size > config.n_positions:
        raise CheckpointError(f"block_size {block_size} exceeds the {config.n_positions} positions of model "
                              f"{source}: lower 'block_size' in the run config to {config.n_positions} or less.")


__all__ = ["SUPPORTED", "CheckpointError", "DecoderConfig", "GPT2ConfigError", "LlamaConfigError",
           "check_block_size", "checkpoint_name", "config_from_json", "embedding_names", "parameter_shapes",
           "read_config"]
