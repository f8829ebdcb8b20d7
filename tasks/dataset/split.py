"""The draws that decide where a document goes, computable inside any work unit: no global pass, no shared state.

Each document has a key that any reader of its file finds the same way: its file's path relative to the dataset's
base and its position in the file (the byte offset where it starts for text and JSON Lines, the row index for
Parquet). A keyed BLAKE2b hash of (seed, key) gives a uniform draw in [0, 1): the document is held out for
validation when its draw is below `val_fraction`, so which documents are held out depends on neither the number
of tasks, nor the unit size, nor which task reads which file (never Python's `hash()`, salted per process). The
BPE sample is drawn the same way, over fixed windows of each file rather than documents, so that a small sample of
a large corpus is read without reading the rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SPLIT_RULE = "blake2b-doc-key/v1"  # part of the fingerprint: changing the draw changes which documents are held out
SAMPLE_RULE = "blake2b-window/v1"
SAMPLE_WINDOW_BYTES = 1 << 20  # text and JSON Lines files are sampled in windows of this many bytes
_SCALE = float(1 << 64)


def _hasher(seed: int, purpose: bytes, relpath: str) -> hashlib.blake2b:
    hasher = hashlib.blake2b(key=seed.to_bytes(8, "little"), digest_size=8, person=purpose)
    hasher.update(relpath.encode("utf-8") + b"\0")
    return hasher


class DocumentDraws:
    """Draws of the documents of one file: `draws(keys)` for their positions in it."""

    def __init__(self, seed: int, relpath: str) -> None:
        self._base = _hasher(seed, b"gptft-split", relpath)

    def draws(self, keys: Sequence[int]) -> list[float]:
        out = []
        for key in keys:
            hasher = self._base.copy()
            hasher.update(key.to_bytes(8, "little"))
            out.append(int.from_bytes(hasher.digest(), "little") / _SCALE)
        return out


def window_draw(seed: int, relpath: str, window: int) -> float:
    """The BPE sample's draw for window (or Parquet row group) `window` of a file."""
    hasher = _hasher(seed, b"gptft-sample", relpath)
    hasher.update(window.to_bytes(8, "little"))
    return int.from_bytes(hasher.digest(), "little") / _SCALE
