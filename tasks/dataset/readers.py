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

Documents are bounded by `max_document_bytes` (the setting `max_document_mb`, in the fingerprint), so that one huge
paragraph, line or cell never sits whole in memory. A paragraph is cut at each multiple M of the cap it crosses
(moved on to the next character's first byte), when no paragraph break lies in the `lookback` bytes before
(min(cap, 64 KiB)): a cut depends only on the bytes around it, so any unit finds the same ones, and no piece is
longer than about cap + lookback. Each piece is a document keyed by its own offset. A JSON line or Parquet cell over
the cap is read whole and its text cut into pieces of at most the cap (at character boundaries), all keyed by the
line or row; a JSON line over `JSON_LINE_FACTOR` caps is refused, as is JSON nested deeper than the parser allows.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Self

from core.storage import filesystem
from tasks.dataset.errors import SourceError
from tasks.dataset.sources import SourceFile

# Source bytes per chunk: ~250k tokens for one encode call (~30 MB of its RSS, twice while the writer appends the
# last call's). 4 MiB chunks peaked at 390-450 MB, growing with the run's length (fragmentation); 1 MiB ~180 MB.
CHUNK_BYTES = 1 << 20
SCAN_BYTES = 4 << 10  # window of the boundary scans (a unit reads this much of its predecessor's last bytes)
MAX_BUFFER_BYTES = 4 * CHUNK_BYTES  # the reader keeps at most about this many of the bytes it fetched
PARQUET_BUFFER_BYTES = 8 << 20  # pyarrow reads a column chunk in pieces of this size
_NEWLINE = re.compile(rb"[\r\n]")
_CONTENT = re.compile(rb"[^\r\n]")
_LINE_END = re.compile(rb"\n")
_NEWLINE_RUN = re.compile(rb"[\r\n]{2,}")  # a paragraph break unless it is exactly one \r\n
_BREAK = re.compile(rb"[\r\n]{3}|\n\n|\r\r|\n\r")  # found inside a window: it holds a paragraph break
DEFAULT_MAX_DOCUMENT_BYTES = 4 << 20  # RunConfig.max_document_mb's default
LOOKBACK_BYTES = 64 << 10
JSON_LINE_FACTOR = 4  # a JSON line is read whole up to this many caps
_CUT_HEAD = 8  # a cut moves past at most this many bytes (continuation bytes, a \r\n) to a character's start
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


def read_documents(reader: SourceReader, kind: str, start: int, end: int, text_column: str,
                   max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> Iterator[DocumentChunk]:
    """The documents of `reader`'s file that start in [start, end) (bytes; row groups for Parquet), in chunks, none
    longer than about `max_document_bytes` (the module's docstring says how they are cut)."""
    cap = max(1, max_document_bytes)
    if kind == "text":
        cuts = _Cuts(reader, cap)
        yield from _ranged(reader, start, end, lambda r, pos, size: next_document_start(r, pos, size, cuts),
                           lambda raw, base, url: _paragraphs(raw, base, url, cuts))
    elif kind == "jsonl":
        yield from _ranged(reader, start, end, lambda r, pos, size: next_line_start(r, pos, size, cap),
                           lambda raw, base, url: _json_lines(raw, base, url, text_column, cap))
    else:
        yield from _parquet_rows(reader, start, end, text_column, cap)


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


def next_document_start(reader: SourceReader, pos: int, size: int, cuts: _Cuts | None = None) -> int:
    """The offset of the first document (a paragraph, or a piece of one at a cut) that starts at or after `pos`;
    `size` when none does. Without `cuts`, paragraphs only. With them the scan never goes further than the next
    cut's grid point, so a unit inside a huge paragraph finds its first document within about one cap."""
    if cuts is None:
        return _paragraph_start(reader, pos, size, size)
    low = pos
    while low < size:
        high = min(size, low + max(cuts.cap, SCAN_BYTES))
        start = _paragraph_start(reader, low, size, high)
        found = cuts.within(low - 1, high)  # every cut in [low, high)
        if found or start < high:
            return min([start, *found])
        low = high
    return size


def _paragraph_start(reader: SourceReader, pos: int, size: int, limit: int) -> int:
    """The offset of the first paragraph that starts in [pos, limit); `limit` when none does (limit <= size).

    The state of `split("\n\n")` at a byte depends only on the newline run it is in or follows, so the scan
    backs up to that run's first byte (or the file's start) and replays from there."""
    if pos >= limit:
        return limit
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
    while cursor < limit:
        run_start = _find(reader, _NEWLINE, cursor, limit)
        if run_start > cursor:  # text before the run: a paragraph is open
            if at_file_start:
                return 0
            at_file_start = False
        if run_start >= limit:
            return limit
        # A run that goes on past limit + 2 starts its paragraph past limit, whatever its length: no need to see it all
        run_end = _find(reader, _CONTENT, run_start, min(size, limit + 2))
        run = reader.read_at(run_start, run_end - run_start)
        newlines = len(run) - run.count(b"\r\n")
        if at_file_start or newlines >= 2:
            # Pairs of newlines end paragraphs; an odd last one starts the next paragraph, else its first byte does.
            start = run_end - (2 if run.endswith(b"\r\n") else 1) if newlines % 2 else run_end
            if pos <= start < size:
                return min(start, limit)
        at_file_start = False
        cursor = run_end
    return limit


class _Cuts:
    """Where a text file's long paragraphs are cut: at grid point g (a multiple of `cap`), the first byte at or
    after g that starts a character other than a newline, when the `lookback` bytes before it hold no paragraph
    break. A pure function of the file's bytes, remembered per grid point."""

    def __init__(self, reader: SourceReader, cap: int) -> None:
        self.reader, self.cap = reader, cap
        self.lookback = min(cap, LOOKBACK_BYTES)
        self._known: dict[int, int | None] = {}

    def at(self, grid: int) -> int | None:
        if grid not in self._known:
            self._known[grid] = self._find(grid)
        return self._known[grid]

    def _find(self, grid: int) -> int | None:
        if grid <= 0 or grid >= self.reader.source.size:
            return None
        head = self.reader.peek(grid, _CUT_HEAD)
        offset = next((i for i, byte in enumerate(head) if byte not in (10, 13) and not 0x80 <= byte < 0xC0), None)
        if offset is None or grid + offset >= self.reader.source.size:
            return None
        cut = grid + offset
        seen = 0  # the window backwards, a scan's worth first: ordinary text has a break within a few KiB
        while seen < self.lookback:
            step = min(SCAN_BYTES, self.lookback - seen)
            # one byte of overlap, so a break across two steps is seen
            window = self.reader.peek(cut - seen - step, step + min(seen, 2))
            if _BREAK.search(window):
                return None
            seen += step
        return cut

    def within(self, low: int, high: int) -> list[int]:
        """The cuts c with low < c < high (file offsets)."""
        first = max(self.cap, (max(low - _CUT_HEAD, 0) // self.cap) * self.cap)
        found = (self.at(grid) for grid in range(first, high, self.cap))
        return sorted({cut for cut in found if cut is not None and low < cut < high})  # two grids, one cut


def _paragraph_spans(raw: bytes) -> Iterator[tuple[int, int]]:
    """[start, end) in `raw` of each non-empty paragraph, as `split("\n\n")` after universal newlines finds them
    (`raw` starts at a document's first byte)."""
    start = 0
    for run in _NEWLINE_RUN.finditer(raw):
        chars = run.group()
        if chars == b"\r\n":
            continue
        if run.start() > start:
            yield start, run.start()
        newlines = len(chars) - chars.count(b"\r\n")
        start = run.end() - (2 if chars.endswith(b"\r\n") else 1) if newlines % 2 else run.end()
    if len(raw) > start:
        yield start, len(raw)


def _paragraphs(raw: bytes, base: int, url: str, cuts: _Cuts | None = None) -> DocumentChunk:
    """The paragraphs of `raw` (pieces of them at `cuts`), which starts at a document's first byte `base` of file
    `url` and ends at another's (or at the end of the file), keyed by the file offset of their first byte."""
    _check_utf8(raw, base, url)
    keys, texts = [], []
    for start, end in _paragraph_spans(raw):
        bounds = [start, *(cut - base for cut in (cuts.within(base + start, base + end) if cuts else ())), end]
        for low, high in itertools.pairwise(bounds):
            keys.append(base + low)
            texts.append(raw[low:high].replace(b"\r\n", b"\n").replace(b"\r", b"\n").decode("utf-8"))
    return DocumentChunk(keys, texts, len(raw))


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


def next_line_start(reader: SourceReader, pos: int, size: int, cap: int = DEFAULT_MAX_DOCUMENT_BYTES) -> int:
    """The offset of the first line that starts at or after `pos`; the scan stops after `JSON_LINE_FACTOR` caps,
    refusing the line that is longer."""
    if pos <= 0:
        return 0
    limit = JSON_LINE_FACTOR * cap
    bound = min(size, pos + limit)
    end = _find(reader, _LINE_END, pos - 1, bound)
    if end >= bound and bound < size:
        raise SourceError(_long_line(reader.source.url, pos, cap))
    return min(end + 1, size)


def _long_line(url: str, offset: int, cap: int) -> str:
    return (f"Source file {url}: the line at or before byte {offset} is longer than {JSON_LINE_FACTOR * cap} bytes "
            f"({JSON_LINE_FACTOR} x the setting 'max_document_mb'), too long to read as one JSON object: split the "
            "record, or raise 'max_document_mb'.")


def _json_lines(raw: bytes, base: int, url: str, column: str, cap: int = DEFAULT_MAX_DOCUMENT_BYTES) -> \
        DocumentChunk:
    _check_utf8(raw, base, url)
    keys, texts, offset = [], [], 0
    for line in raw.split(b"\n"):
        if len(line) > JSON_LINE_FACTOR * cap:
            raise SourceError(_long_line(url, base + offset, cap))
        if line.strip():
            pieces = split_text(_text_of(line, base + offset, url, column), cap)
            keys += [base + offset] * len(pieces)
            texts += pieces
        offset += len(line) + 1
    return DocumentChunk(keys, texts, len(raw))


def split_text(text: str, cap: int) -> list[str]:
    """`text` in pieces of at most `cap` UTF-8 bytes, cut at character boundaries (itself when it fits)."""
    if len(text) * 4 <= cap:
        return [text]
    data = text.encode("utf-8")
    if len(data) <= cap:
        return [text]
    pieces, start = [], 0
    while start < len(data):
        end = min(start + cap, len(data))
        while end < len(data) and 0x80 <= data[end] < 0xC0:  # never inside a character
            end -= 1
        end = end if end > start else min(start + 4, len(data))  # a cap below one character: one character
        pieces.append(data[start:end].decode("utf-8"))
        start = end
    return pieces


def _text_of(line: bytes, offset: int, url: str, column: str) -> str:
    try:
        row = json.loads(line)
    except ValueError as error:
        raise SourceError(f"Source file {url}: the line at byte {offset} is not JSON ({error}). JSON Lines files "
                          "hold one JSON object per line.") from None
    except RecursionError:
        raise SourceError(f"Source file {url}: the line at byte {offset} is JSON nested deeper than the parser "
                          f"allows (about {sys.getrecursionlimit()} levels): flatten the record.") from None
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


def _parquet_rows(reader: SourceReader, first: int, end: int, column: str,
                  cap: int = DEFAULT_MAX_DOCUMENT_BYTES) -> Iterator[DocumentChunk]:
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
            pieces = [split_text(text or "", cap) for text in texts]
            yield DocumentChunk([row + i for i, cell in enumerate(pieces) for _ in cell],
                                [piece for cell in pieces for piece in cell], len(texts))
            row += len(texts)
