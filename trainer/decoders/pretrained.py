"""Decoders from a preset or a Hugging Face checkpoint directory, and checkpoints written from them.

Reading checks everything it can before a weight is read: the config.json (architecture, values), the index (shard
names stay in the directory), every file's header (each tensor's name, shape and dtype against the model's) and the
block size. Then the files are staged locally (object storage: downloaded into the work directory) and read with
safetensors' `safe_open`, memory-mapped, one tensor at a time, converted to float32 and assigned to the model's
(possibly mirrored) variable of the same name: the host holds the weights once, plus one tensor.

Writing produces what transformers 5's `save_pretrained` writes for the model's architecture in float32
(config.json, model.safetensors with metadata {"format": "pt"} and no tied head; generation_config.json), plus the
tokenizer's files, published whole with config.json last (docs/model.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from core import storage
from trainer.decoders.architectures import (
    CONFIG_FILE,
    CheckpointError,
    DecoderConfig,
    check_block_size,
    checkpoint_name,
    embedding_names,
    parameter_shapes,
    preset_config,
    read_config,
)
from trainer.decoders.llama_config import LlamaConfig
from trainer.decoders.safetensors_io import (
    INDEX_FILE,
    WEIGHTS_FILE,
    TensorEntry,
    check_entries,
    checkpoint_entries,
    write_file,
)

log = logging.getLogger("trainer.decoders")

GENERATION_CONFIG_FILE = "generation_config.json"
# A tokenizer directory's files that are a model's, not copied beside a written model.
MODEL_FILE_NAMES = frozenset({CONFIG_FILE, GENERATION_CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE, "tf_model.h5",
                              "pytorch_model.bin"})


@dataclasses.dataclass(frozen=True)
class CheckedCheckpoint:
    """A checkpoint directory whose config and tensor headers fit a model: `tensors` maps the model's weight names
    to where each is stored."""

    directory: str
    config: DecoderConfig
    tensors: Mapping[str, TensorEntry]


def check_checkpoint(directory: str, *, block_size: int | None = None) -> CheckedCheckpoint:
    """Read and check the checkpoint at `directory` (a path or URL) without reading a weight; CheckpointError naming
    the file, the tensor or the key, and the fix."""
    config = read_config(directory)
    if block_size is not None:
        check_block_size(config, block_size, directory)
    tensors = check_entries(checkpoint_entries(directory), parameter_shapes(config), directory,
                            renamed=lambda name: checkpoint_name(config, name))
    return CheckedCheckpoint(directory, config, tensors)


def build_decoder(config: DecoderConfig, *, compute_dtype: str = "float32", seed: int = 0, initializer=None):
    """The decoder of `config`'s architecture (random init from `seed` unless `initializer` is given); call inside
    the strategy's scope."""
    if isinstance(config, LlamaConfig):
        from trainer.decoders.llama import LlamaDecoder

        return LlamaDecoder(config, compute_dtype=compute_dtype, seed=seed, initializer=initializer)
    from trainer.decoders.gpt2 import GPT2Decoder

    return GPT2Decoder(config, compute_dtype=compute_dtype, seed=seed, initializer=initializer)


def build_preset(preset: str, *, vocab_size: int, eos_token_id: int, block_size: int, compute_dtype: str = "float32",
                 seed: int = 0):
    """A randomly initialised decoder of a core.config MODEL_PRESETS shape with the tokenizer's vocabulary."""
    config = preset_config(preset, vocab_size=vocab_size, eos_token_id=eos_token_id)
    check_block_size(config, block_size, f"preset {preset!r}")
    log.info("Model: preset %r (random init, seed %d), vocab %d", preset, seed, vocab_size)
    return build_decoder(config, compute_dtype=compute_dtype, seed=seed)


def load_pretrained(path: str | Path, *, vocab_size: int | None = None, block_size: int | None = None,
                    compute_dtype: str = "float32", seed: int = 0, work_dir: str | Path | None = None):
    """The decoder saved in the checkpoint directory `path` (local or object storage), its call on int token ids
    [batch, time] giving float32 logits [batch, time, vocab].

    `vocab_size` (the tokenizer's) resizes the token embedding as the trainer always has: extra rows drawn from a
    normal(0, initializer_range) truncated at two standard deviations (seeded by `seed`), surplus rows dropped.
    `block_size` is refused beyond the model's positions. Object storage files are staged in `work_dir` (a
    temporary directory, removed afterwards, without one). Call inside the strategy's scope to get its variables.
    """
    from trainer.decoders.base import zeros_init

    checked = check_checkpoint(str(path), block_size=block_size)
    config = checked.config
    if vocab_size is not None and vocab_size != config.vocab_size:
        log.info("Resizing token embeddings %d -> %d to match the tokenizer", config.vocab_size, vocab_size)
        config = dataclasses.replace(config, vocab_size=vocab_size)
    model = build_decoder(config, compute_dtype=compute_dtype, initializer=zeros_init)
    assign_weights(model, checked, seed=seed, work_dir=work_dir)
    log.info("Model: %s loaded from %s", type(model).__name__, path)
    return model


def assign_weights(model, checked: CheckedCheckpoint, *, seed: int = 0, work_dir: str | Path | None = None) -> None:
    """Copy the checkpoint's tensors onto the model's variables of the same names, one at a time, as float32."""
    from safetensors import safe_open

    with _staged(checked, work_dir) as local, contextlib.ExitStack() as stack:
        # Opening every file first checks each one's offsets against its length before any tensor is read.
        files = {file: stack.enter_context(safe_open(str(local / file), framework="tf"))
                 for file in sorted({entry.file for entry in checked.tensors.values()})}
        resized = embedding_names(model.config)
        for name, variable in model.weights.items():
            entry = checked.tensors[name]
            value = files[entry.file].get_tensor(entry.name)
            if name in resized and value.shape[0] != variable.shape[0]:
                value = resized_embedding(value, int(variable.shape[0]), model.config.initializer_range, seed,
                                          name=name)
            variable.assign(_float32(value))


def _float32(value):
    import tensorflow as tf

    return tf.cast(value, tf.float32)


def resized_embedding(value, rows: int, stddev: float, seed: int, *, name: str):
    """The embedding `value` (the weight `name`) with `rows` rows: its first rows kept, new ones drawn as the
    trainer's resize always has (truncated normal, `stddev`), the same on every worker for one seed."""
    import tensorflow as tf

    from trainer.decoders.base import name_seed

    value = _float32(value)
    known = int(value.shape[0])
    if rows <= known:
        return value[:rows]
    new = tf.random.stateless_truncated_normal([rows - known, int(value.shape[1])],
                                               seed=name_seed(seed, name + ":resized"), stddev=stddev)
    return tf.concat([value, new], axis=0)


@contextlib.contextmanager
def _staged(checked: CheckedCheckpoint, work_dir: str | Path | None) -> Iterator[Path]:
    """A local directory holding the checkpoint's weight files: its own when local, else a download of each."""
    files = sorted({entry.file for entry in checked.tensors.values()})
    directory = checked.directory
    fs, path = storage.filesystem(directory)
    if storage.is_local(fs):
        yield Path(path)
        return
    with contextlib.ExitStack() as stack:
        base = Path(work_dir) if work_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        local = base / f"model-{hashlib.sha256(directory.encode()).hexdigest()[:16]}"
        for file in files:
            storage.download_file(storage.join(directory, file), local / file)
        yield local


def save_pretrained(model, url: str, *, tokenizer_dir: str | Path | None = None) -> list[str]:
    """Write `model` as a Hugging Face checkpoint directory at `url` (replacing what is there), loadable unchanged
    by transformers 5's `AutoModelForCausalLM.from_pretrained` (PyTorch) and vLLM; the tokenizer's files from
    `tokenizer_dir` beside it. Returns the file names written. Every worker may call it; give non-chief workers a
    scratch `url` (nothing here runs collectives)."""
    config = model.config
    weights = model.weights
    shapes = {name: tuple(int(dim) for dim in variable.shape) for name, variable in weights.items()}
    if shapes != parameter_shapes(config):
        raise CheckpointError(f"the model's weights do not match its config ({type(config).__name__}): refusing "
                              f"to write {url}.")
    with storage.staging_directory(url) as stage:
        write_file(stage / WEIGHTS_FILE, shapes, lambda name: np.asarray(weights[name].numpy(), np.float32),
                   {"format": "pt"})
        _write_json(stage / GENERATION_CONFIG_FILE, config.generation_config())
        if tokenizer_dir is not None:
            _copy_tokenizer(str(tokenizer_dir), stage)
        names = sorted([path.name for path in stage.iterdir()] + [CONFIG_FILE])
        storage.publish_directory(stage, url, last=(CONFIG_FILE, _json_bytes(config.to_json())))
    log.info("Model written to %s: %s", url, ", ".join(names))
    return names


def _copy_tokenizer(source: str, stage: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        local = storage.local_copy(source, scratch)
        if not local.is_dir():
            raise CheckpointError(f"tokenizer directory {source} is missing.")
        for path in sorted(local.iterdir()):
            if path.is_file() and path.name not in MODEL_FILE_NAMES and not path.name.endswith(".safetensors"):
                shutil.copy2(path, stage / path.name)


def _json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _write_json(path: Path, value) -> None:
    path.write_bytes(_json_bytes(value))


__all__ = ["CheckedCheckpoint", "assign_weights", "build_decoder", "build_preset", "check_checkpoint",
           "load_pretrained", "resized_embedding", "save_pretrained"]
