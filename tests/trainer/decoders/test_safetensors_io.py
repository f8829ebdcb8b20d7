"""safetensors headers, the index of shards and the streaming writer, read back by safetensors itself."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.trainer.decoders.golden import FIXTURES
from trainer.decoders.architectures import CheckpointError
from trainer.decoders.safetensors_io import checkpoint_entries, read_header, weight_map, write_file


def test_headers_give_every_tensor_its_file_dtype_and_shape_without_the_metadata():
    header = read_header(str(FIXTURES / "gpt2-tiny" / "model.safetensors"))
    assert "__metadata__" not in header and header["transformer.wte.weight"]["shape"] == [100, 16]
    sharded = checkpoint_entries(str(FIXTURES / "gpt2-tiny-sharded"))
    single = checkpoint_entries(str(FIXTURES / "gpt2-tiny"))
    assert {name: entry.shape for name, entry in sharded.items()} == {n: e.shape for n, e in single.items()}
    assert {entry.file for entry in sharded.values()} == {"model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"}
    assert {entry.dtype for entry in checkpoint_entries(str(FIXTURES / "gpt2-tiny-bf16")).values()} == {"BF16"}


def test_the_writer_streams_a_file_safetensors_reads_back_exactly(tmp_path):
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    tensors = {"b.weight": rng.normal(size=(3, 5)).astype(np.float32), "a.bias": np.arange(7, dtype=np.float32)}
    shapes = {name: value.shape for name, value in tensors.items()}
    write_file(tmp_path / "model.safetensors", shapes, tensors.__getitem__, {"format": "pt"})
    with safe_open(str(tmp_path / "model.safetensors"), "numpy") as handle:
        assert handle.metadata() == {"format": "pt"}
        for name, value in tensors.items():
            np.testing.assert_array_equal(handle.get_tensor(name), value)
    header_bytes = int.from_bytes((tmp_path / "model.safetensors").read_bytes()[:8], "little")
    assert header_bytes % 8 == 0  # the tensors start aligned, as safetensors' own writer pads


def test_the_writer_refuses_a_tensor_of_another_shape_or_dtype(tmp_path):
    with pytest.raises(CheckpointError, match=r"tensor x is float64 \[2\], not float32 \[2\]"):
        write_file(tmp_path / "a.safetensors", {"x": (2,)}, lambda name: np.zeros(2), {})
    with pytest.raises(CheckpointError, match=r"tensor x is float32 \[3\], not float32 \[2\]"):
        write_file(tmp_path / "b.safetensors", {"x": (2,)}, lambda name: np.zeros(3, np.float32), {})


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "..", ""])
def test_an_index_whose_shard_names_leave_the_directory_is_refused(tmp_path, shard):
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "gpt2-tiny-sharded", directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"]["transformer.wte.weight"] = shard
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="tensor 'transformer.wte.weight' is in shard .* which is not a file of"):
        weight_map(str(directory))


def test_an_index_that_misplaces_a_tensor_is_refused(tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "gpt2-tiny-sharded", directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    moved = next(name for name, file in index["weight_map"].items() if file.startswith("model-00001"))
    index["weight_map"][moved] = "model-00002-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"does not match its shards: tensors not in the shard it names: "
                                              f"\\['{moved}'\\]"):
        checkpoint_entries(str(directory))


def test_a_file_that_is_no_safetensors_is_refused(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    (tmp_path / "text.safetensors").write_bytes((12).to_bytes(8, "little") + b"not json at all")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        read_header(str(tmp_path / "short.safetensors"))
    with pytest.raises(CheckpointError, match="its header is not JSON"):
        read_header(str(tmp_path / "text.safetensors"))
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor model.safetensors.index.json"):
        weight_map(str(tmp_path))
