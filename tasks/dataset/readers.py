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

import json
import re
import sys
from collections.abc import Iterator
from typing import Any

from tasks.dataset.errors import SourceError
from tasks.dataset.paragraphs import Cuts, next_document_start, paragraph_chunk
from tasks.dataset.ranges import CHUNK_BYTES, DocumentChunk, SourceReader, decode_utf8, find_pattern, ranged_chunks

PARQUET_BUFFER_BYTES = 8 << 20  # pyarrow reads a column chunk in pieces of this size
_LINE_END = re.compile(rb"\n")
DEFAULT_MAX_DOCUMENT_BYTES = 4 << 20  # RunConfig.max_document_mb's default
JSON_LINE_FACTOR = 4  # a JSON line is read whole up to this many caps
_STRING_TYPES = ("string", "large_string", "string_view")


def read_documents(reader: SourceReader, kind: str, start: int, end: int, text_column: str,
                   max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES) -> Iterator[DocumentChunk]:
    """The documents of `reader`'s file that start in [start, end) (bytes; row groups for Parquet), in chunks, none
    longer than about `max_document_bytes` (the module's docstring says how they are cut)."""
    cap = max(1, max_document_bytes)
    if kind == "text":
        cuts = Cuts(reader, cap)
        yield from ranged_chunks(reader, start, end, lambda r, pos, size: next_document_start(r, pos, size, cuts),
                                 lambda raw, base, url: paragraph_chunk(raw, base, url, cuts))
    elif kind == "jsonl":
        yield from ranged_chunks(reader, start, end, lambda r, pos, size: next_line_start(r, pos, size, cap),
                                 lambda raw, base, url: _json_lines(raw, base, url, text_column, cap))
    else:
        yield from _parquet_rows(reader, start, end, text_column, cap)


# -- JSON Lines -------------------------------------------------------------------------------------------------


def next_line_start(reader: SourceReader, pos: int, size: int, cap: int = DEFAULT_MAX_DOCUMENT_BYTES) -> int:
    """The offset of the first line that starts at or after `pos`; the scan stops after `JSON_LINE_FACTOR` caps,
    refusing the line that is longer."""
    if pos <= 0:
        return 0
    limit = JSON_LINE_FACTOR * cap
    bound = min(size, pos + limit)
    end = find_pattern(reader, _LINE_END, pos - 1, bound)
    if end >= bound and bound < size:
        raise SourceError(_long_line(reader.source.url, pos, cap))
    return min(end + 1, size)


def _long_line(url: str, offset: int, cap: int) -> str:
    return (f"Source file {url}: the line at or before byte {offset} is longer than {JSON_LINE_FACTOR * cap} bytes "
            f"({JSON_LINE_FACTOR} x the setting 'max_document_mb'), too long to read as one JSON object: split the "
            "record, or raise 'max_document_mb'.")


def _json_lines(raw: bytes, base: int, url: str, column: str, cap: int = DEFAULT_MAX_DOCUMENT_BYTES) -> \
        DocumentChunk:
    decode_utf8(raw, base, url)
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
