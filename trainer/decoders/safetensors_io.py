"""safetensors files without loading them: the headers (names, dtypes, shapes) of a checkpoint's files, read with
two ranged reads each so an object-storage checkpoint is checked before its weights are downloaded; the index of
shards; the checks of a checkpoint's tensors against a model's; and a writer that streams one tensor at a time.

The format (github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header mapping each
tensor name to {dtype, shape, data_offsets} (offsets into the data that follows), `__metadata__` (str -> str),
padding to 8 bytes, then the tensors' bytes, little-endian, C order.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from core import storage
from trainer.decoders.architectures import CheckpointError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensor dtypes read (each converted to float32 on loading).
SUPPORTED_DTYPES = ("F32", "BF16", "F16")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint: its name in the file, the file (relative to the directory), dtype and shape."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]


def read_header(url: str) -> dict[str, dict]:
    """The header of the safetensors file at `url`, its tensors only (`__metadata__` left out)."""
    try:
        (length,) = struct.unpack("<Q", storage.read_range(url, 0, 8))
    except FileNotFoundError:
        raise CheckpointError(f"{url} is missing: the checkpoint names it but it is not there.") from None
    except struct.error:
        raise CheckpointError(f"{url} is not a safetensors file (shorter than its 8-byte header length).") from None
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{url} is not a safetensors file (a header of {length} bytes).")
    try:
        header = json.loads(storage.read_range(url, 8, 8 + length))
    except ValueError:
        raise CheckpointError(f"{url} is not a safetensors file (its header is not JSON).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{url} is not a safetensors file (its header is not a JSON object).")
    header.pop("__metadata__", None)
    return header


def weight_map(directory: str) -> dict[str, str] | None:
    """The index's tensor name -> shard file of a sharded checkpoint, None for one `model.safetensors`; shard names
    that are not plain file names in the directory (`../x`, `/x`, `a/b`) are refused."""
    index_url = storage.join(directory, INDEX_FILE)
    if not storage.exists(index_url):
        if not storage.exists(storage.join(directory, WEIGHTS_FILE)):
            raise CheckpointError(f"{directory} has neither {WEIGHTS_FILE} nor {INDEX_FILE}: save the model with "
                                  "safetensors (save_pretrained's default), or convert its pytorch_model.bin.")
        return None
    try:
        mapping = storage.read_json(index_url).get("weight_map")
    except (ValueError, AttributeError):
        raise CheckpointError(f"{index_url} is not a JSON object.") from None
    if not isinstance(mapping, dict) or not mapping:
        raise CheckpointError(f"{index_url} has no 'weight_map' of tensor names to shard files.")
    for name, file in mapping.items():
        if not isinstance(file, str) or not _plain_file_name(file):
            raise CheckpointError(f"{index_url}: tensor {name!r} is in shard {file!r}, which is not a file of "
                                  f"{directory}: shard names must be plain file names in the checkpoint directory.")
    return mapping


def _plain_file_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def checkpoint_entries(directory: str) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint in `directory` by its name, from the headers of its files (each where the
    index says it is)."""
    mapping = weight_map(directory)
    entries: dict[str, TensorEntry] = {}
    for file in sorted(set(mapping.values())) if mapping else [WEIGHTS_FILE]:
        url = storage.join(directory, file)
        for name, info in read_header(url).items():
            if name in entries:
                raise CheckpointError(f"tensor {name!r} is in both {entries[name].file} and {file} of {directory}.")
            if not isinstance(info, dict) or not isinstance(info.get("shape"), list):
                raise CheckpointError(f"{url}: tensor {name!r} has no shape in the header.")
            entries[name] = TensorEntry(name, file, str(info.get("dtype")), tuple(info["shape"]))
    misplaced = sorted(name for name in (mapping or {}) if name not in entries or entries[name].file != mapping[name])
    unlisted = sorted(name for name in entries if mapping is not None and name not in mapping)
    if misplaced or unlisted:
        raise CheckpointError(f"{storage.join(directory, INDEX_FILE)} does not match its shards: tensors not in the "
                              f"shard it names: {misplaced[:5]}; tensors it does not list: {unlisted[:5]}.")
    return entries


def check_entries(entries: Mapping[str, TensorEntry], expected: Mapping[str, tuple[int, ...]], directory: str,
                  *, renamed: Callable[[str], str | None]) -> dict[str, TensorEntry]:
    """The checkpoint's tensors under the model's names (`renamed`: a file's name -> the model's, None for one the
    model ignores); CheckpointError naming every missing, extra or mis-shaped tensor (with both shapes) and every
    unsupported dtype."""
    found: dict[str, TensorEntry] = {}
    extra = []
    for entry in entries.values():
        name = renamed(entry.name)
        if name is None:
            continue
        if name not in expected or name in found:
            extra.append(entry.name)
        else:
            found[name] = entry
    problems = [f"missing tensor {name} {list(shape)}" for name, shape in expected.items() if name not in found]
    problems += [f"extra tensor {name} {list(entries[name].shape)} (the model has no such weight)"
                 for name in extra]
    for name, entry in found.items():
        want = expected[name]
        if entry.shape != want:
            problems.append(f"tensor {entry.name} has shape {list(entry.shape)}, the model's is {list(want)}")
        if entry.dtype not in SUPPORTED_DTYPES:
            problems.append(f"tensor {entry.name} has dtype {entry.dtype}: supported are {', '.join(SUPPORTED_DTYPES)}")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{directory} does not fit its config.json: {shown}. Use a checkpoint written for "
                              "this config (or fix config.json to match the weights).")
    return found


def write_file(path: Path, shapes: Mapping[str, tuple[int, ...]], read: Callable[[str], np.ndarray],
               metadata: Mapping[str, str]) -> None:
    """A float32 safetensors file of the tensors `shapes` names, each taken from `read(name)` as it is written:
    one tensor in memory at a time. Laid out as safetensors' own writer lays out one dtype (tensors by name,
    compact JSON, the header padded with spaces to 8 bytes), so the same tensors give the same bytes."""
    names = sorted(shapes)
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in names:
        size = 4 * math.prod(shapes[name])
        header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for name in names:
            array = read(name)
            if array.shape != tuple(shapes[name]) or array.dtype != np.float32:
                raise CheckpointError(f"tensor {name} is {array.dtype} {list(array.shape)}, not float32 "
                                      f"{list(shapes[name])}: refusing to write {path}.")
            handle.write(np.ascontiguousarray(array).astype("<f4", copy=False).tobytes())
