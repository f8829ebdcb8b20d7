"""Documents streamed from one part of one source file, in chunks of about 1 MiB: never a whole file in memory.

A work unit (`tasks.dataset.units`) owns the documents whose first byte (text, JSON Lines) or row (Parquet) lies in
its range, and reads past its end to finish the last one, the rule of Hadoop's and dask's byte ranges. So any cut
of a file into ranges yields every document exactly once, each whole and the same, and each unit finds its first
document from its own range: a cut inside a multi-byte character, inside a `\\r\\n` or inside a paragraph moves to
the next document's start.

Text files: documents are paragraphs exactly as `text.split("\\n\\n")` gives them after universal newlines
(`\\r\\n` and `\\r` read as `\\n`), empty pieces dropped; a run of k newlines thus ends a paragraph when k >= 2, and
when k is odd its last newline starts the next one. A document's key is the byte offset of its first byte.
JSON Lines: one document per non-blank line, the string in `text_column` (null reads as ""), keyed by the line's
offset. Parquet: one document per row of `text_column`, read a row group range at a time with only that column,
keyed by the row's index in the file. Reads go to storage in chunks of exactly what is needed (fsspec with no read-ahead
cache), so the bytes fetched are the unit's plus a few KiB of boundary scans; `SourceReader.fetched` counts them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from tasks.dataset.errors import SourceError
from tasks.dataset.sources import SourceFile
from trainer.storage import filesystem

# Source bytes per chunk: ~250k tokens for one encode call (~30 MB of its RSS, twice while the writer appends the
# last call's). 4 MiB chunks peaked at 390-450 MB, growing with the run's length (fragmentation); 1 MiB ~180 MB.
CHUNK_BYTES = 1 << 20
SCAN_BYTES = 4 << 10  # window of the boundary scans (a unit reads this much of its predecessor's last bytes)
MAX_BUFFER_BYTES = 4 * CHUNK_BYTES  # the reader keeps at most about this many of the bytes it fetched
PARQUET_BUFFER_BYTES = 8 << 20  # pyarrow reads a column chunk in pieces of this size
_NEWLINE = re.compile(rb"[\r\n]")
_CONTENT = re.compile(rb"[^\r\n]")
_LINE_END = re.compile(rb"\n")
_STRING_TYPES = ("string", "large_string", "string_view")


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


def read_documents(reader: SourceReader, kind: str, start: int, end: int, text_column: str) -> Iterator[DocumentChunk]:
    """The documents of `reader`'s file that start in [start, end) (bytes; row groups for Parquet), in chunks."""
    if kind == "text":
        yield from _ranged(reader, start, end, next_document_start, _paragraphs)
    elif kind == "jsonl":
        yield from _ranged(reader, start, end, next_line_start, lambda raw, base, url: _json_lines(
            raw, base, url, text_column))
    else:
        yield from _parquet_rows(reader, start, end, text_column)


# -- text -------------------------------------------------------------------------------------------------------


def _find(reader: SourceReader, pattern: re.Pattern[bytes], start: int, size: int) -> int:
    """The offset of the first byte at or after `start` that `pattern` matches, else `size`."""
    while start < size:
        window = reader.read_at(start, min(SCAN_BYTES, size - start))
        match = pattern.search(window)
        if match:
            return start + match.start()
        start += len(window)
    return size


def next_document_start(reader: SourceReader, pos: int, size: int) -> int:
    """The offset of the first paragraph that starts at or after `pos`; `size` when none does.

    The state of `split("\\n\\n")` at a byte depends only on the newline run it is in or follows, so the scan
    backs up to that run's first byte (or the file's start) and replays from there."""
    if pos >= size:
        return size
    begin = pos
    while begin > 0:
        window_start = max(0, begin - SCAN_BYTES)
        window = reader.read_at(window_start, begin - window_start)
        kept = len(window.rstrip(b"\r\n"))
        begin = window_start + kept
        if kept:
            break
    at_file_start = begin == 0
    cursor = begin
    while cursor < size:
        run_start = _find(reader, _NEWLINE, cursor, size)
        if run_start > cursor:  # text before the run: a paragraph is open
            if at_file_start:
                return 0
            at_file_start = False
        if run_start >= size:
            return size
        run_end = _find(reader, _CONTENT, run_start, size)
        run = reader.read_at(run_start, run_end - run_start)
        newlines = len(run) - run.count(b"\r\n")
        if at_file_start or newlines >= 2:
            # Pairs of newlines end paragraphs; an odd last one starts the next paragraph, else its first byte does.
            start = run_end - (2 if run.endswith(b"\r\n") else 1) if newlines % 2 else run_end
            if pos <= start < size:
                return start
        at_file_start = False
        cursor = run_end
    return size


def _paragraphs(raw: bytes, base: int, url: str) -> DocumentChunk:
    """The paragraphs of `raw`, which starts at a paragraph's first byte `base` of file `url` and ends at another's
    (or at the end of the file), keyed by the file offset of their first byte."""
    _check_utf8(raw, base, url)
    consumed = len(raw)
    crlf_positions = None
    if b"\r" in raw:
        octets = np.frombuffer(raw, np.uint8)
        pairs = np.flatnonzero((octets[:-1] == 13) & (octets[1:] == 10))
        crlf_positions = pairs - np.arange(len(pairs))  # where each \r\n's \n lands once they are normalized
        raw = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    keys, texts, offset = [], [], 0
    for piece in raw.split(b"\n\n"):
        if piece:
            keys.append(offset)
            texts.append(piece.decode("utf-8"))
        offset += len(piece) + 2
    if crlf_positions is not None and len(crlf_positions):
        keys = (np.asarray(keys, dtype=np.int64) + np.searchsorted(crlf_positions, keys, side="left")).tolist()
    return DocumentChunk([base + key for key in keys], texts, consumed)


def _check_utf8(raw: bytes, base: int, url: str) -> None:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        raise SourceError(
            f"Source file {url} is not valid UTF-8: byte 0x{raw[bad.start]:02x} at offset {base + bad.start}. "
            "Re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove it from 'dataset'."
        ) from None


def _ranged(reader: SourceReader, start: int, end: int, next_start, parse) -> Iterator[DocumentChunk]:
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


# -- JSON Lines -------------------------------------------------------------------------------------------------


def next_line_start(reader: SourceReader, pos: int, size: int) -> int:
    """The offset of the first line that starts at or after `pos`."""
    if pos <= 0:
        return 0
    return min(_find(reader, _LINE_END, pos - 1, size) + 1, size)


def _json_lines(raw: bytes, base: int, url: str, column: str) -> DocumentChunk:
    _check_utf8(raw, base, url)
    keys, texts, offset = [], [], 0
    for line in raw.split(b"\n"):
        if line.strip():
            keys.append(base + offset)
            texts.append(_text_of(line, base + offset, url, column))
        offset += len(line) + 1
    return DocumentChunk(keys, texts, len(raw))


def _text_of(line: bytes, offset: int, url: str, column: str) -> str:
    try:
        row = json.loads(line)
    except ValueError as error:
        raise SourceError(f"Source file {url}: the line at byte {offset} is not JSON ({error}). JSON Lines files "
                          "hold one JSON object per line.") from None
    if not isinstance(row, dict):
        hint = " (a JSON array file: convert it with `jq -c '.[]' in.json > out.jsonl`)" if \
            isinstance(row, list) else ""
        raise SourceError(f"Source file {url}: the line at byte {offset} is a JSON {type(row).__name__}, not an "
                          f"object{hint}.")
    if column not in row:
        raise SourceError(
            f"Setting 'text_column' = {column!r} is not a field of {url}: the line at byte {offset} has fields "
            f"{sorted(row)[:20]}. Set 'text_column' to the one holding the text.")
    text = row[column]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise SourceError(f"Field {column!r} of {url} holds {type(text).__name__} at the line at byte {offset}, not "
                          "text: set 'text_column' to a string field.")
    return text


# -- Parquet ----------------------------------------------------------------------------------------------------


def parquet_layout(reader: SourceReader, column: str) -> list[dict[str, int]]:
    """Rows and text bytes (uncompressed) of each row group, from the footer; refuses a file without the column
    or whose column is not text, before anything is read."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(reader).metadata
    except Exception as error:  # noqa: BLE001 - pyarrow raises ArrowInvalid and OSError alike
        raise SourceError(f"Source file {reader.source.url} is not a readable Parquet file: {error}") from None
    schema = metadata.schema.to_arrow_schema()
    if column not in schema.names:
        raise SourceError(
            f"Setting 'text_column' = {column!r} is not a column of {reader.source.url}: the columns are "
            f"{schema.names}. Set 'text_column' to the one holding the text.")
    kind = str(schema.field(column).type)
    if kind not in _STRING_TYPES:
        raise SourceError(f"Column {column!r} of {reader.source.url} holds {kind}, not text: set 'text_column' "
                          "to a string column.")
    index = schema.get_field_index(column)
    return [{"rows": metadata.row_group(g).num_rows,
             "bytes": metadata.row_group(g).column(index).total_uncompressed_size}
            for g in range(metadata.num_row_groups)]


def _parquet_rows(reader: SourceReader, first: int, end: int, column: str) -> Iterator[DocumentChunk]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(reader, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False)
    metadata = parquet.metadata
    row = sum(metadata.row_group(g).num_rows for g in range(first))
    for group in range(first, end):
        stats = metadata.row_group(group)
        text_bytes = stats.column(parquet.schema_arrow.get_field_index(column)).total_uncompressed_size
        rows_per_batch = max(1, CHUNK_BYTES * stats.num_rows // max(text_bytes, 1))
        for batch in parquet.iter_batches(batch_size=rows_per_batch, row_groups=[group], columns=[column],
                                          use_threads=False):
            texts: list[Any] = batch.column(0).to_pylist()
            yield DocumentChunk(list(range(row, row + len(texts))), [text or "" for text in texts], len(texts))
            row += len(texts)
