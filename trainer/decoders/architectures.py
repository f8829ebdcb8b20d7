"""Which Hugging Face architectures the decoders read, and a checkpoint's config.json read and checked by them.

Nothing here imports TensorFlow: a checkpoint's config is refused (another architecture, a value the decoder
cannot build, a block size beyond its positions) before anything expensive starts.
"""

from __future__ import annotations

from typing import Any

from core import storage
from core.document import DocumentError
from trainer.decoders import gpt2_config
from trainer.decoders.gpt2_config import GPT2Config, GPT2ConfigError

CONFIG_FILE = "config.json"
# `architectures[0]` of a config.json -> its config type; a config without `architectures` is read by model_type.
CONFIG_TYPES: dict[str, type[GPT2Config]] = {gpt2_config.ARCHITECTURE: GPT2Config}
MODEL_TYPES = {gpt2_config.MODEL_TYPE: gpt2_config.ARCHITECTURE}
SUPPORTED = tuple(CONFIG_TYPES)

DecoderConfig = GPT2Config  # the union of the supported configs as architectures are added


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
    config_type = CONFIG_TYPES[architecture_of(value, source)]
    try:
        return config_type.from_json(value, source)
    except DocumentError as error:
        raise CheckpointError(f"{error} Fix {CONFIG_FILE} or use another checkpoint.") from None
    except GPT2ConfigError as error:
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


def check_block_size(config: DecoderConfig, block_size: int, source: str) -> None:
    """Refuse a block size beyond the model's learned positions."""
    if block_size > config.n_positions:
        raise CheckpointError(f"block_size {block_size} exceeds the {config.n_positions} positions of model "
                              f"{source}: lower 'block_size' in the run config to {config.n_positions} or less.")


__all__ = ["SUPPORTED", "CheckpointError", "DecoderConfig", "GPT2ConfigError", "check_block_size",
           "config_from_json", "read_config"]
