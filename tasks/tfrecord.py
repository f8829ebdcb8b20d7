"""TFRecord files written with numpy alone, so the prepare task never pays TensorFlow's multi-second import.

A TFRecord is `uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)`, little-endian;
TensorFlow's reader verifies both checksums. Python has no CRC-32C (Castagnoli) built in and a per-byte loop
would cost more than tokenizing, so the CRC runs vectorised: each record is cut into lanes of `_LANE` bytes,
all lanes of all records advance one byte per numpy step, and the lane CRCs are folded together with a
precomputed "append one lane of zero bytes" operator (CRC is linear over GF(2)). Lanes of about sqrt(record
size) bytes balance the two loops.
"""

from __future__ import annotations

from functools import lru_cache
from typing import BinaryIO

import numpy as np

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), bit-reflected
_MASK_DELTA = 0xA282EAD8


def _byte_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(_POLY), table >> 1).astype(np.uint32)
    return table


_TABLE = _byte_table()


def _advance(state: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Feed `data[..., j]` for every j into the raw CRC registers `state` (no init, no final xor)."""
    for column in range(data.shape[-1]):
        state = _TABLE[(state ^ data[..., column]) & 0xFF] ^ (state >> 8)
    return state


@lru_cache(maxsize=8)
def _zero_shift_tables(nbytes: int) -> np.ndarray:
    """Tables T[k][v]: the register `v << 8k` after `nbytes` zero bytes; any register is the xor of 4 lookups."""
    registers = (np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None])
    return _advance(registers, np.zeros((4, 256, nbytes), dtype=np.uint8))


def crc32c_rows(rows: np.ndarray) -> np.ndarray:
    """CRC-32C of every row of a uint8 matrix `[records, nbytes]` (nbytes >= 4), as uint32."""
    count, nbytes = rows.shape
    if nbytes < 4:
        raise ValueError(f"crc32c_rows needs rows of at least 4 bytes, got {nbytes}")
    lane_bytes = 64 if nbytes <= 8192 else 256
    shift = _zero_shift_tables(lane_bytes)
    pad = (-nbytes) % lane_bytes
    padded = np.zeros((count, pad + nbytes), dtype=np.uint8)
    padded[:, pad:] = rows
    # Starting the register at 0xFFFFFFFF equals complementing the first four message bytes; leading zero
    # padding leaves a zero register unchanged, so the padded rows give the same CRC.
    padded[:, pad:pad + 4] ^= 0xFF
    lanes = padded.reshape(count, -1, lane_bytes)
    lane_crcs = _advance(np.zeros(lanes.shape[:2], dtype=np.uint32), lanes)
    crc = np.zeros(count, dtype=np.uint32)
    for lane in range(lanes.shape[1]):
        crc = (
            shift[0][crc & 0xFF] ^ shift[1][(crc >> 8) & 0xFF] ^ shift[2][(crc >> 16) & 0xFF] ^ shift[3][crc >> 24]
        ) ^ lane_crcs[:, lane]
    return crc ^ np.uint32(0xFFFFFFFF)


def masked_crc32c_rows(rows: np.ndarray) -> np.ndarray:
    crc = crc32c_rows(rows)
    return (((crc >> 15) | (crc << 17)) + np.uint32(_MASK_DELTA)).astype(np.uint32)


def framed_records(payloads: np.ndarray) -> bytes:
    """TFRecord bytes for equal-length records, given as a uint8 matrix `[records, payload_bytes]`."""
    count, nbytes = payloads.shape
    lengths = np.full(count, nbytes, dtype="<u8")
    out = np.empty((count, 12 + nbytes + 4), dtype=np.uint8)
    out[:, 0:8] = lengths.view(np.uint8).reshape(count, 8)
    out[:, 8:12] = masked_crc32c_rows(out[:, 0:8]).astype("<u4").view(np.uint8).reshape(count, 4)
    out[:, 12:12 + nbytes] = payloads
    out[:, 12 + nbytes:] = masked_crc32c_rows(payloads).astype("<u4").view(np.uint8).reshape(count, 4)
    return out.tobytes()


def write_sequence_records(handle: BinaryIO, sequences: np.ndarray, sequences_per_record: int) -> int:
    """Write `[n, block_size]` little-endian token rows as records of `sequences_per_record` rows (the last
    may hold fewer); returns the number of records."""
    flat = np.ascontiguousarray(sequences.astype(sequences.dtype.newbyteorder("<"), copy=False))
    full, rest = divmod(len(flat), sequences_per_record)
    row_bytes = flat.shape[1] * flat.dtype.itemsize
    raw = flat.view(np.uint8).reshape(len(flat), row_bytes)
    if full:
        handle.write(framed_records(raw[: full * sequences_per_record].reshape(full, -1)))
    if rest:
        handle.write(framed_records(raw[full * sequences_per_record:].reshape(1, -1)))
    return full + (1 if rest else 0)
