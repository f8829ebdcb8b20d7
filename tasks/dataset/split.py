"""The draws that decide where a document goes, computable inside any work unit: no global pass, no shared state.

Each document has a key that any reader of its file finds the same way: its file's path relative to the dataset's
base and its position in the file (the byte offset where it starts for text and JSON Lines, the row index for
Parquet). A keyed BLAKE2b hash of (seed, file) gives the file a 64-bit key, and SplitMix64's output function at
(key, position) a uniform draw in [0, 1), computed for a whole chunk of positions at once (numpy): the document is
held out for validation when its draw is below `val_fraction`, so which documents are held out depends on neither
the number of tasks, nor the unit size, nor which task reads which file (never Python's `hash()`, salted per
process). The BPE sample is drawn the same way, over fixed windows of each file rather than documents, so that a
small sample of a large corpus is read without reading the rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

# Part of the fingerprint: changing the draw changes which documents are held out.
SPLIT_RULE = "blake2b-file-key+splitmix64-position/v2"
SAMPLE_RULE = "blake2b-window/v1"
SAMPLE_WINDOW_BYTES = 1 << 20  # text and JSON Lines files are sampled in windows of this many bytes
_SCALE = float(1 << 64)


def _hasher(seed: int, purpose: bytes, relpath: str) -> hashlib.blake2b:
    hasher = hashlib.blake2b(key=seed.to_bytes(8, "little"), digest_size=8, person=purpose)
    hasher.update(relpath.encode("utf-8") + b"\0")
    return hasher


# SplitMix64 (Steele, Lea and Flood 2014): its output at step `position` of the sequence seeded with the file's key.
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_UNIT = 2.0 ** -53  # the top 53 bits as a double in [0, 1): never 1.0


class DocumentDraws:
    """Draws of the documents of one file: `array(keys)` for their positions in it (`held_out` says which of them
    validation holds)."""

    def __init__(self, seed: int, relpath: str) -> None:
        self._key = np.uint64(int.from_bytes(_hasher(seed, b"gptft-split", relpath).digest(), "little"))

    def array(self, keys: Sequence[int]) -> np.ndarray:
        """The draws as float64."""
        positions = np.asarray(keys, dtype=np.uint64)
        with np.errstate(over="ignore"):  # arithmetic modulo 2**64, as SplitMix64 defines it
            z = self._key + (positions + np.uint64(1)) * _GAMMA
            z = (z ^ (z >> np.uint64(30))) * _MIX1
            z = (z ^ (z >> np.uint64(27))) * _MIX2
            z ^= z >> np.uint64(31)
        return (z >> np.uint64(11)).astype(np.float64) * _UNIT


def window_draw(seed: int, relpath: str, window: int) -> float:
    """The BPE sample's draw for window (or Parquet row group) `window` of a file."""
    hasher = _hasher(seed, b"gptft-sample", relpath)
    hasher.update(window.to_bytes(8, "little"))
    return int.from_bytes(hasher.digest(), "little") / _SCALE


def held_out(drawn: np.ndarray, val_fraction: float) -> np.ndarray:
    """True for each document validation holds: its draw (`DocumentDraws.array`) is below `val_fraction`."""
    return drawn < val_fraction
