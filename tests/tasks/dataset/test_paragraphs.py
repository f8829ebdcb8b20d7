"""A chunk's paragraphs: the one-split path (no \\r, no cut in the chunk) gives the same documents and keys as the
path that walks the newline runs, which handles \\r and cuts; both are `split("\\n\\n")` after universal newlines."""

from __future__ import annotations

import random

import pytest

from tasks.dataset.errors import SourceError
from tasks.dataset.paragraphs import _cut_paragraphs, paragraph_chunk

PIECES = ["a", "bc", "é", "€", "😀", " ", "\t", "\n", "\n\n", "\n\n\n", "\n\n\n\n"]


def _split(raw: bytes) -> list[str]:
    return [piece for piece in raw.decode("utf-8").split("\n\n") if piece]


@pytest.mark.parametrize("ascii_only", [True, False])
def test_one_split_gives_the_documents_and_keys_of_the_newline_walk(ascii_only):
    rng = random.Random(5)
    pieces = [p for p in PIECES if p.isascii()] if ascii_only else PIECES
    for _ in range(500):
        raw = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40))).encode("utf-8")
        base = rng.randint(0, 1 << 40)
        fast = paragraph_chunk(raw, base, "plays.txt")
        walked = _cut_paragraphs(raw, base, [])
        assert (fast.keys, fast.texts, fast.consumed) == (walked.keys, walked.texts, walked.consumed), raw
        assert fast.texts == _split(raw), raw
        for key, text in zip(fast.keys, fast.texts, strict=True):
            assert raw[key - base:].decode("utf-8").startswith(text), (raw, key)


def test_a_chunk_with_a_carriage_return_reads_it_as_a_newline():
    chunk = paragraph_chunk("one\r\n\r\ntwo\rstill two\r\rthree €".encode(), 100, "plays.txt")
    assert chunk.texts == ["one", "two\nstill two", "three €"]
    assert chunk.keys == [100, 107, 122]


@pytest.mark.parametrize(("raw", "offset"), [(b"fine\n\ncaf\xe9", 19), (b"fine\r\n\r\ncaf\xe9", 21)])
def test_invalid_utf8_is_refused_on_either_path(raw, offset):
    with pytest.raises(SourceError, match=rf"x.txt is not valid UTF-8: byte 0xe9 at offset {offset}\."):
        paragraph_chunk(raw, 10, "x.txt")
