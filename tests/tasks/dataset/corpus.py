"""Shared helpers of the prepare-stage tests: settings, corpora made here, and an independent reading of what the
stage wrote (a TFRecord reader with its own CRC-32C, and the documents and draws computed without the stage)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from core import storage
from core.config import RunConfig
from tasks.dataset.split import DocumentDraws

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "data" / "sample"
WORDS = ["the", "of", "and", "to", "in", "that", "is", "was", "he", "for", "it", "with", "as", "his", "on", "be",
         "at", "by", "I", "had", "not", "are", "but", "from", "or", "have"]


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _make_table() -> list[int]:
    table = []
    for value in range(256):
        for _ in range(8):
            value = (value >> 1) ^ 0x82F63B78 if value & 1 else value >> 1
        table.append(value)
    return table


_CRC_TABLE = _make_table()


def masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def reference_crc32c(data: bytes) -> int:
    return _crc32c(data)


def read_tfrecords(data: bytes) -> list[bytes]:
    """Parse TFRecord framing, checking both CRCs of every record."""
    records, offset = [], 0
    while offset < len(data):
        header = data[offset:offset + 8]
        (length,) = np.frombuffer(header, "<u8")
        assert int(np.frombuffer(data[offset + 8:offset + 12], "<u4")[0]) == masked(_crc32c(header))
        payload = data[offset + 12:offset + 12 + int(length)]
        footer = data[offset + 12 + int(length):offset + 16 + int(length)]
        assert int(np.frombuffer(footer, "<u4")[0]) == masked(_crc32c(payload))
        records.append(payload)
        offset += 16 + int(length)
    assert offset == len(data)
    return records


def config(tmp_path: Path, **overrides) -> RunConfig:
    settings = {"dataset": str(SAMPLE / "*.txt"), "tokenizer": "bpe:512", "block_size": 32, "num_workers": 2,
                "storage_root": str(tmp_path / "storage")}
    return RunConfig(**(settings | overrides))


def text_documents(paths: list[Path], base: Path) -> list[tuple[str, int, str]]:
    """(relative path, byte offset, paragraph) of every document of plain-text files without \\r, file by file:
    `split("\\n\\n")`, empty pieces dropped, each keyed by where it starts."""
    documents = []
    for path in paths:
        raw = path.read_bytes()
        assert b"\r" not in raw
        offset = 0
        for piece in raw.split(b"\n\n"):
            if piece:
                documents.append((os.path.relpath(path, base), offset, piece.decode("utf-8")))
            offset += len(piece) + 2
    return documents


def held_out(documents: list[tuple[str, int, str]], cfg: RunConfig) -> list[bool]:
    """Which documents the stage holds out: its keyed draw, at least one and never all."""
    draws = [DocumentDraws(cfg.seed, relpath).array([key]).tolist()[0] for relpath, key, _ in documents]
    mask = [draw < cfg.val_fraction for draw in draws]
    if not any(mask):
        mask[int(np.argmin(draws))] = True
    if all(mask):
        mask[int(np.argmax(draws))] = False
    return mask


def sample_documents() -> list[tuple[str, int, str]]:
    return text_documents(sorted(SAMPLE.glob("*.txt")), SAMPLE)


def dataset_names(manifest_url: str) -> list[str]:
    directory = manifest_url.rsplit("/", 1)[0]
    fs, path = storage.filesystem(directory)
    return [os.path.relpath(name, path) for name in fs.find(path)]


def dataset_files(manifest_url: str) -> dict[str, bytes]:
    directory = manifest_url.rsplit("/", 1)[0]
    fs, path = storage.filesystem(directory)
    return {os.path.relpath(name, path): fs.cat_file(name) for name in fs.find(path)}


def shard_files(manifest_url: str) -> dict[str, bytes]:
    """The dataset's files but the manifest (which records when and how it was made)."""
    return {name: data for name, data in dataset_files(manifest_url).items() if name != "manifest.json"}


def comparable(manifest: dict) -> dict:
    """The manifest without what must differ between runs on other storage or fan-outs: URLs, times, fingerprint,
    the stage's own units and lanes."""
    stripped = json.loads(json.dumps(manifest))
    for key in ("created_at", "fingerprint", "prepare"):
        stripped.pop(key)
    stripped["sources"] = [{"size": source["size"]} for source in stripped["sources"]]
    return stripped


def shard_tokens(manifest_url: str, split: str) -> np.ndarray:
    files = dataset_files(manifest_url)
    shards = storage.read_json(manifest_url)["splits"][split]["shards"]
    return np.concatenate([np.frombuffer(r, "<u2") for s in shards for r in read_tfrecords(files[s["name"]])])


def write_corpus(directory: Path, files: int = 2, paragraphs: int = 60, seed: int = 7) -> Path:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        text = "\n\n".join(" ".join(rng.choice(WORDS, size=rng.integers(5, 40))) for _ in range(paragraphs))
        (directory / f"part-{index}.txt").write_text(text + "\n", encoding="utf-8")
    return directory


def two_part_corpus(directory: Path) -> Path:
    """Two text files of 2000 short paragraphs each: enough for a plan of two lanes with tiny units."""
    directory.mkdir(parents=True)
    for index in range(2):
        (directory / f"part-{index}.txt").write_text(
            "\n\n".join(f"{index} {i} " + "word " * 60 for i in range(2000)))
    return directory
