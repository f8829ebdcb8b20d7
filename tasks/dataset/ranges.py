"""Ranged reads of one source file, the part every reader shares: the file opened for ranged reads counting what
it fetches (`SourceReader`), pattern scans over it, and the loop that cuts a byte range into chunks of documents
(the rules of which documents a range owns are in `tasks.dataset.readers`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Self

from core.storage import filesystem
from tasks.dataset.errors import SourceError
from tasks.dataset.sources import SourceFile

# Source bytes per chunk: ~250k tokens for one encode call (~30 MB of its RSS, twice while the writer appends the
# last call's). 4 MiB chunks peaked at 390-450 MB, growing with the run's length (fragmentation); 1 MiB ~180 MB.
CHUNK_BYTES = 1 << 20
SCAN_BYTES = 4 << 10  # window of the boundary scans (a unit reads this much of its predecessor's last bytes)
MAX_BUFFER_BYTES = 4 * CHUNK_BYTES  # the reader keeps at most about this many of the bytes it fetched


@dataclass(frozen=True)
class DocumentChunk:
    keys: list[int]  # each document's position in its file (byte offset, or row index for Parquet)
    texts: list[str]
    consumed: int  # how much of the unit this chunk covers, in the unit's measure (bytes, or rows for Parquet)


class SourceReader:
    """One source file opened for ranged reads, counting the bytes fetched from storage (`fetched`). It keeps the
    bytes of its last read and extends them when the next read continues them, so reading on sequentially fetches
    each byte once, and unlike a read-ahead cache it never fetches past what was asked. Also the file object
    pyarrow reads Parquet through."""

    def __init__(self, source: SourceFile) -> None:
        self.source = source
        fs, path = filesystem(source.url)
        self._file = fs.open(path, "rb", cache_type="none")
        self._start, self._buffer = 0, b""
        self._position = 0
        self.fetched = 0

    def read_at(self, offset: int, length: int) -> bytes:
        end = min(offset + length, self.source.size)
        if not self._start <= offset <= self._start + len(self._buffer):
            self._start, self._buffer = offset, b""
        elif len(self._buffer) > MAX_BUFFER_BYTES:
            # Bounded: what lies well before this read goes. A scan's read comes up to a chunk after the read of
            # the chunk it cuts, which must still find its bytes here.
            keep = max(self._start, offset - 2 * CHUNK_BYTES)
            self._start, self._buffer = keep, self._buffer[keep - self._start:]
        if end > self._start + len(self._buffer):
            self._file.seek(self._start + len(self._buffer))
            more = self._file.read(end - self._start - len(self._buffer))
            self.fetched += len(more)
            self._buffer += more
        return self._buffer[offset - self._start:max(offset, end) - self._start]

    def peek(self, offset: int, length: int) -> bytes:
        """Bytes at `offset` without moving the kept bytes (a look behind a cut): from them when they hold it."""
        offset, end = max(0, offset), min(offset + length, self.source.size)
        if self._start <= offset and end <= self._start + len(self._buffer):
            return self._buffer[offset - self._start:end - self._start]
        self._file.seek(offset)
        data = self._file.read(max(0, end - offset))
        self.fetched += len(data)
        return data

    # -- the file protocol pyarrow uses ---------------------------------------------------------------------------

    def read(self, length: int = -1) -> bytes:
        data = self.read_at(self._position, self.source.size - self._position if length < 0 else length)
        self._position += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self.source.size}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._file.closed

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def find_pattern(reader: SourceReader, pattern: re.Pattern[bytes], start: int, size: int) -> int:
    """The offset of the first byte at or after `start` that `pattern` matches, else `size`."""
    while start < size:
        window = reader.read_at(start, min(SCAN_BYTES, size - start))
        match = pattern.search(window)
        if match:
            return start + match.start()
        start += len(window)
    return size


def decode_utf8(raw: bytes, base: int, url: str) -> str:
    """`raw` (from byte `base` of file `url`) as text; refused, naming the first bad byte, when it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise SourceError(
            f"Source file {url} is not valid UTF-8: byte 0x{raw[bad.start]:02x} at offset {base + bad.start}. "
            "Re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove it from 'dataset'."
        ) from None


def ranged_chunks(reader: SourceReader, start: int, end: int, next_start: Callable[[SourceReader, int, int], int],
                  parse: Callable[[bytes, int, str], DocumentChunk]) -> Iterator[DocumentChunk]:
    """Chunks of about CHUNK_BYTES, each cut at a document start, of the documents starting in [start, end)."""
    size = reader.source.size
    position = next_start(reader, start, size)
    while position < min(end, size):
        # The bulk first, never past the range's end; the cut's scan then continues those bytes (fetching only
        # what lies beyond them), and the last cut is the first document start at or after `end`.
        target = min(position + CHUNK_BYTES, end)
        reader.read_at(position, target - position)
        cut = next_start(reader, target, size)
        yield parse(reader.read_at(position, cut - position), position, reader.source.url)
        position = cut
