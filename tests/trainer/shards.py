"""Write a tiny tokenized dataset in the CONTRACTS.md format, for trainer tests and benchmarks.

A byte-level BPE tokenizer trained here (transformers `save_pretrained` format), TFRecord shards of uint16
token sequences (`sequences_per_record` sequences per record), and `manifest.json` written last.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(texts, trainer=trainer)
    return GPT2TokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def _write_shard(path: Path, records: list[np.ndarray]) -> dict:
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record.astype("<u2").tobytes())
    data = path.read_bytes()
    sequences = sum(len(r) for r in records)
    return {
        "name": path.name, "records": len(records), "sequences": sequences,
        "tokens": int(sum(r.size for r in records)), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
    }


def _split_records(tokens: np.ndarray, block_size: int, per_record: int, num_shards: int, split: str, directory: Path):
    sequences = tokens[: len(tokens) // block_size * block_size].reshape(-1, block_size)
    records = [sequences[i: i + per_record] for i in range(0, len(sequences) - per_record + 1, per_record)]
    shards = [
        _write_shard(directory / f"{split}-{i:05d}-of-{num_shards:05d}.tfrecord", records[i::num_shards])
        for i in range(num_shards)
    ]
    return {"sequences": sum(s["sequences"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "shards": shards}


def write_dataset(
    directory: Path,
    text_files: list[Path],
    *,
    block_size: int = 32,
    vocab_size: int = 320,
    num_train_shards: int = 4,
    sequences_per_record: int = 4,
    val_fraction: float = 0.05,
    max_chars: int | None = None,
) -> str:
    """Tokenize `text_files` into shards + manifest under `directory/<fingerprint>/`, as prepare lays a dataset out;
    returns the manifest path."""
    texts = [f.read_text(encoding="utf-8")[:max_chars] for f in text_files]
    tokenizer = train_tokenizer(texts, vocab_size)
    ids = np.concatenate([np.array(tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]) for t in texts])
    fingerprint = hashlib.sha256(ids.tobytes() + f"{block_size},{num_train_shards},{val_fraction}".encode()
                                 ).hexdigest()[:20]
    directory = directory / fingerprint
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory / "tokenizer"))
    cut = int(len(ids) * (1 - val_fraction))
    splits = {
        "train": _split_records(ids[:cut], block_size, sequences_per_record, num_train_shards, "train", directory),
        "validation": _split_records(ids[cut:], block_size, sequences_per_record, 1, "validation", directory),
    }
    manifest = {
        "format_version": 1, "fingerprint": fingerprint,
        "created_at": datetime.now(UTC).isoformat(), "dtype": "uint16", "block_size": block_size,
        "sequences_per_record": sequences_per_record,
        "tokenizer": {"spec": f"bpe:{vocab_size}", "fingerprint": "test", "vocab_size": len(tokenizer),
                      "eos_token_id": tokenizer.eos_token_id, "path": "tokenizer"},
        "sources": [{"url": str(f), "size": f.stat().st_size, "mtime": ""} for f in text_files],
        "settings": {"text_column": "text", "val_fraction": val_fraction, "seed": 0, "num_shards": num_train_shards},
        "splits": splits,
    }
    manifest_path = directory / "manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return str(manifest_path)
