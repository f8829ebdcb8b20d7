"""Documents read from byte ranges: for every cut of a file into ranges, the ranges' documents together are the
whole file's, each once, whole, with the same key; cuts inside a multi-byte character, a \\r\\n or a paragraph
included. Checked against the plain global reading (`split("\\n\\n")` after universal newlines), on real files."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from tasks.dataset.errors import SourceError
from tasks.dataset.paragraphs import LOOKBACK_BYTES
from tasks.dataset.ranges import SourceReader
from tasks.dataset.readers import DEFAULT_MAX_DOCUMENT_BYTES, parquet_layout, read_documents, split_text
from tasks.dataset.sources import SourceFile


def _source(path: Path) -> SourceFile:
    return SourceFile(str(path), path.stat().st_size, "", path.name)


def _read(path: Path, kind: str, cuts: list[int], column: str = "text", cap: int | None = None) -> \
        list[tuple[int, str]]:
    bounds = [0, *cuts, _source(path).size if kind != "parquet" else cuts[-1]]
    documents = []
    for start, end in itertools.pairwise(bounds):
        with SourceReader(_source(path)) as reader:
            for chunk in read_documents(reader, kind, start, end, column, *([cap] if cap else [])):
                assert all(start <= key < end for key in chunk.keys) or kind == "parquet"
                documents += zip(chunk.keys, chunk.texts, strict=True)
    return documents


def _paragraphs(raw: bytes) -> list[str]:
    text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    return [piece for piece in text.split("\n\n") if piece]


PIECES = ["a", "bc", "é", "€", "😀", " ", "\n", "\r\n", "\r", "\n\n", "\n\n\n", "\r\n\r\n", "\r\r\n"]


def test_every_cut_of_a_text_file_gives_its_paragraphs_once_each(tmp_path):
    rng = random.Random(11)
    for trial in range(250):
        raw = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30))).encode("utf-8")
        path = tmp_path / f"t{trial}.txt"
        path.write_bytes(raw)
        whole = _read(path, "text", [])
        assert [text for _, text in whole] == _paragraphs(raw), raw
        for key, text in whole:  # a key is where its paragraph starts in the file's bytes
            tail = raw[key:].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
            assert tail.startswith(text), (raw, key, text)
        cut_sets = [list(range(1, len(raw)))] + [sorted(rng.sample(range(1, len(raw)), min(3, len(raw) - 1)))
                                                 for _ in range(6)] if len(raw) > 1 else []
        for cuts in cut_sets:
            assert _read(path, "text", cuts) == whole, (raw, cuts)


def test_cuts_inside_a_character_a_crlf_and_a_paragraph_move_to_the_next_paragraph(tmp_path):
    path = tmp_path / "cuts.txt"
    raw = "one paragraph with €uro\r\n\r\nsecond paragraph\r\nstill second\r\n\r\n\r\nthird".encode()
    path.write_bytes(raw)
    inside_euro = raw.index("€".encode()) + 1
    inside_crlf = raw.index(b"\r\n\r\n") + 1
    inside_paragraph = raw.index(b"still") + 2
    whole = _read(path, "text", [])
    assert [text for _, text in whole] == ["one paragraph with €uro", "second paragraph\nstill second", "\nthird"]
    for cut in (inside_euro, inside_crlf, inside_paragraph):
        assert _read(path, "text", [cut]) == whole, cut


def test_invalid_utf8_names_the_file_and_the_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"fine text\n\ncaf\xe9 au lait\n")
    with pytest.raises(SourceError, match=r"latin1.txt is not valid UTF-8: byte 0xe9 at offset 14"):
        _read(path, "text", [])
    with pytest.raises(SourceError, match=r"byte 0xe9 at offset 14"):
        _read(path, "text", [12])  # the unit that owns the paragraph reports the file offset


def test_json_lines_every_cut_gives_each_row_once(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"id": i, "body": f"row {i} é€" + "x" * (i % 7), "other": None} for i in range(40)]
    lines = [json.dumps(row, ensure_ascii=False) for row in rows]
    lines.insert(5, "")  # a blank line is no document
    path.write_text("\n".join(lines) + "\r\n", encoding="utf-8")
    whole = _read(path, "jsonl", [], column="body")
    assert [text for _, text in whole] == [row["body"] for row in rows]
    raw = path.read_bytes()
    assert [key for key, _ in whole] == [raw.index(json.dumps(r, ensure_ascii=False).encode()) for r in rows]
    for cuts in ([1], [len(raw) // 3, 2 * len(raw) // 3], list(range(1, len(raw), 17))):
        assert _read(path, "jsonl", cuts, column="body") == whole, cuts


@pytest.mark.parametrize(("content", "message"), [
    ('{"body": "a"}\n{"text": "b"}\n', (r"'text_column' = 'body' is not a field of .*rows.jsonl: the line at byte 14 "
                                       r"has fields \['text'\]")),
    ('{"body": "a"}\nnot json\n', r"the line at byte 14 is not JSON"),
    ('{"body": 7}\n', r"Field 'body' of .* holds int .* not text"),
    ('[{"body": "a"}]\n', r"is a JSON list, not an object \(a JSON array file: convert it with `jq"),
])
def test_bad_json_lines_name_the_file_the_line_and_the_fix(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SourceError, match=message):
        _read(path, "jsonl", [], column="body")


def test_parquet_row_group_ranges_give_each_row_once_with_its_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    texts = [f"document {i} " + "word " * (i % 11) if i % 13 else None for i in range(1000)]
    pq.write_table(pa.table({"id": list(range(1000)), "body": texts}), path, row_group_size=64)
    with SourceReader(_source(path)) as reader:
        groups = parquet_layout(reader, "body")
    assert len(groups) == 16 and sum(g["rows"] for g in groups) == 1000
    whole = _read(path, "parquet", [len(groups)], column="body")
    assert whole == [(i, text or "") for i, text in enumerate(texts)]
    assert _read(path, "parquet", [3, 4, 11, len(groups)], column="body") == whole
    with SourceReader(_source(path)) as reader, pytest.raises(SourceError, match=r"the columns are \['id', 'body'\]"):
        parquet_layout(reader, "text")
    with SourceReader(_source(path)) as reader, pytest.raises(SourceError, match=r"holds int64, not text"):
        parquet_layout(reader, "id")


def test_the_bytes_fetched_are_the_ranges_bytes(tmp_path):
    """No read-ahead past what a range needs: all ranges together fetch about the file once."""
    path = tmp_path / "big.txt"
    paragraph = ("word " * 200 + "\n") * 3
    path.write_text("\n".join(paragraph for _ in range(4000)), encoding="utf-8")
    size = path.stat().st_size
    fetched = 0
    for piece in range(4):
        with SourceReader(_source(path)) as reader:
            list(read_documents(reader, "text", piece * size // 4, (piece + 1) * size // 4, "text"))
            fetched += reader.fetched
    print(f"\n4 ranges of {size / 2**20 / 4:.1f} MiB: fetched {fetched / size:.4f}x the file")
    assert size <= fetched <= 1.01 * size


# -- documents bounded by max_document_mb (issue 37, review finding 8) -----------------------------------------


def _pieces_make_paragraphs(pieces: list[str], paragraphs: list[str]) -> bool:
    """Consecutive pieces concatenate to each paragraph in turn, nothing left over."""
    at = 0
    for paragraph in paragraphs:
        joined = ""
        while len(joined) < len(paragraph) and at < len(pieces):
            joined += pieces[at]
            at += 1
        if joined != paragraph:
            return False
    return at == len(pieces)


LONG_PIECES = [*PIECES, "word " * 9, "€" * 7, "x" * 23, "😀😀😀"]


@pytest.mark.parametrize("cap", [4, 8, 16, 64])
def test_a_paragraph_over_the_cap_is_cut_the_same_way_by_every_cut_of_the_file(tmp_path, cap):
    rng = random.Random(cap)
    limit = cap + min(cap, LOOKBACK_BYTES) + 10
    for trial in range(120):
        raw = "".join(rng.choice(LONG_PIECES if rng.random() < 0.8 else PIECES)
                      for _ in range(rng.randint(0, 25))).encode("utf-8")
        path = tmp_path / f"t{trial}.txt"
        path.write_bytes(raw)
        whole = _read(path, "text", [], cap=cap)
        assert _pieces_make_paragraphs([text for _, text in whole], _paragraphs(raw)), (raw, whole)
        assert all(len(text.encode()) <= limit for _, text in whole), (raw, whole)
        assert [key for key, _ in whole] == sorted({key for key, _ in whole})
        for key, text in whole:
            tail = raw[key:].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
            assert tail.startswith(text), (raw, key, text)
        if len(raw) > 1:
            for cuts in [sorted(rng.sample(range(1, len(raw)), min(k, len(raw) - 1))) for k in (1, 3, 9)]:
                assert _read(path, "text", cuts, cap=cap) == whole, (raw, cuts)


def test_one_huge_paragraph_is_read_in_pieces_of_the_cap(tmp_path):
    """The review's reproduction: 48 MiB without a blank line was one document, held whole (here 12 MiB)."""
    path = tmp_path / "one_paragraph.txt"
    with open(path, "wb") as f:
        f.writelines(b"word " * 204 + b"\n" for _ in range(12 * 1024))
    source = _source(path)
    longest, total, documents = 0, 0, 0
    for start, end in ((0, source.size // 2), (source.size // 2, source.size)):
        with SourceReader(source) as reader:
            for chunk in read_documents(reader, "text", start, end, "text"):
                longest = max([longest, *map(len, chunk.texts)])
                total += sum(map(len, chunk.texts))
                documents += len(chunk.texts)
    assert total == source.size and documents == 3
    assert longest <= DEFAULT_MAX_DOCUMENT_BYTES + LOOKBACK_BYTES + 10


def test_a_long_json_line_is_cut_into_pieces_with_its_key(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"body": "short"}, {"body": "€uro " * 30}, {"body": "end"}]
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    whole = _read(path, "jsonl", [], column="body", cap=64)
    raw = path.read_bytes()
    second = raw.index(b"\n") + 1
    assert [k for k, _ in whole] == [0] + [second] * 4 + [raw.rindex(b"{")]  # 210 bytes: 64 + 62 + 64 + 20
    assert "".join(t for k, t in whole if k == second) == rows[1]["body"]
    assert all(len(t.encode()) <= 64 for _, t in whole)
    for cuts in ([second + 3], [second + 100, second + 200], list(range(1, len(raw), 29))):
        assert _read(path, "jsonl", cuts, column="body", cap=64) == whole, cuts


def test_a_json_line_over_four_caps_names_the_file_the_offset_and_the_setting(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"body": "a"}\n{"body": "' + "x" * 300 + '"}\n{"body": "b"}\n', encoding="utf-8")
    message = r"rows.jsonl: the line at or before byte 14 is longer than 256 bytes .*'max_document_mb'"
    with pytest.raises(SourceError, match=message):
        _read(path, "jsonl", [], column="body", cap=64)
    with pytest.raises(SourceError, match=r"rows.jsonl: the line at or before byte \d+ is longer than 256 bytes"):
        _read(path, "jsonl", [40], column="body", cap=64)  # a unit starting inside it stops scanning, too


def test_deep_json_names_the_file_and_the_offset(tmp_path):
    """The review's reproduction: a line nested 100000 deep raised RecursionError."""
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine"}\n{"text": ' + "[" * 100000 + "\n")
    with pytest.raises(SourceError, match=r"deep.jsonl: the line at byte 17 is JSON nested deeper than the parser"):
        _read(path, "jsonl", [], cap=1 << 20)


def test_a_parquet_cell_over_the_cap_is_cut_into_pieces_with_its_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    texts = ["small", "ü" * 100, None, "tail"]
    pq.write_table(pa.table({"body": texts}), path, row_group_size=2)
    whole = _read(path, "parquet", [2], column="body", cap=64)
    assert [k for k, _ in whole] == [0, 1, 1, 1, 1, 2, 3]
    assert "".join(t for k, t in whole if k == 1) == texts[1] and all(len(t.encode()) <= 64 for _, t in whole)


@pytest.mark.parametrize("text, cap, pieces", [
    ("abc", 2, ["ab", "c"]), ("€€", 4, ["€", "€"]), ("😀", 2, ["😀"]), ("", 3, [""]), ("ab", 2, ["ab"]),
])
def test_split_text_cuts_at_character_boundaries(text, cap, pieces):
    assert split_text(text, cap) == pieces
