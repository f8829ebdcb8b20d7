"""Text files: their documents are paragraphs, pieces of long ones cut at a grid of the document cap (the rules are
in `tasks.dataset.readers`' docstring): where a range's first document starts, where the cuts lie, and a chunk's
paragraphs.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

from tasks.dataset.ranges import SCAN_BYTES, DocumentChunk, SourceReader, decode_utf8, find_pattern

_NEWLINE = re.compile(rb"[\r\n]")
_CONTENT = re.compile(rb"[^\r\n]")
_NEWLINE_RUN = re.compile(rb"[\r\n]{2,}")  # a paragraph break unless it is exactly one \r\n
_BREAK = re.compile(rb"[\r\n]{3}|\n\n|\r\r|\n\r")  # found inside a window: it holds a paragraph break
LOOKBACK_BYTES = 64 << 10
_CUT_HEAD = 8  # a cut moves past at most this many bytes (continuation bytes, a \r\n) to a character's start


def next_document_start(reader: SourceReader, pos: int, size: int, cuts: Cuts | None = None) -> int:
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
        run_start = find_pattern(reader, _NEWLINE, cursor, limit)
        if run_start > cursor:  # text before the run: a paragraph is open
            if at_file_start:
                return 0
            at_file_start = False
        if run_start >= limit:
            return limit
        # A run that goes on past limit + 2 starts its paragraph past limit, whatever its length: no need to see it all
        run_end = find_pattern(reader, _CONTENT, run_start, min(size, limit + 2))
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


class Cuts:
    """Where a text file's long paragraphs are cut: at grid point g (a multiple of `cap`), the first byte at or
    after g that starts a character other than a newline, when the `lookback` bytes before it hold no paragraph
    break. A pure function of the file's bytes, remembered per grid point."""

    def __init__(self, reader: SourceReader, cap: int) -> None:
        self.reader, self.cap = reader, cap
        self.lookback = min(cap, LOOKBACK_BYTES)
        self._known: dict[int, int | None] = {}

    def at(self, grid: int) -> int | None:
        if grid not in self._known:
            self._known[grid] = self._cut_at(grid)
        return self._known[grid]

    def _cut_at(self, grid: int) -> int | None:
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


def paragraph_chunk(raw: bytes, base: int, url: str, cuts: Cuts | None = None) -> DocumentChunk:
    """The paragraphs of `raw` (pieces of them at `cuts`), which starts at a document's first byte `base` of file
    `url` and ends at another's (or at the end of the file), keyed by the file offset of their first byte.

    The cuts are looked up once for the chunk. A chunk without a cut or a \r (the usual one) is `split("\n\n")`
    itself, decoded once: the bytes' split gives the offsets, the text's the documents, piece for piece ("\n" is
    one byte in UTF-8)."""
    text = decode_utf8(raw, base, url)
    inside = cuts.within(base, base + len(raw)) if cuts else []
    if inside or b"\r" in raw:
        return _cut_paragraphs(raw, base, inside)
    texts = text.split("\n\n")
    lengths = list(map(len, texts if raw.isascii() else raw.split(b"\n\n")))
    starts = itertools.accumulate(map((2).__add__, lengths), initial=base)
    return DocumentChunk(list(itertools.compress(starts, lengths)), list(filter(None, texts)), len(raw))


def _cut_paragraphs(raw: bytes, base: int, cuts: list[int]) -> DocumentChunk:
    """The paragraphs of `raw` after universal newlines, cut at `cuts` (file offsets inside the chunk)."""
    keys, texts = [], []
    for start, end in _paragraph_spans(raw):
        bounds = [start, *(cut - base for cut in cuts if base + start < cut < base + end), end]
        for low, high in itertools.pairwise(bounds):
            keys.append(base + low)
            texts.append(raw[low:high].replace(b"\r\n", b"\n").replace(b"\r", b"\n").decode("utf-8"))
    return DocumentChunk(keys, texts, len(raw))
