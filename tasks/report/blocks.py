"""The shapes a report's view is made of (tasks/report/view.py builds them, report.md and the UI's run page write
them): sections of paragraphs, bullet lists, tables, warnings and charts, with three marks inside a line (emphasis,
code and a verdict). Plain text: each writer decides how they look and escapes what its format needs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Emphasis:
    text: str


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Verdict:
    """A pass/fail word, as `label: text` where a label is given; `passed` None is neither (e.g. "pending")."""
    text: str
    passed: bool | None
    label: str = ""
    anchor: str | None = None  # the page's element id


Mark = str | Emphasis | Code | Verdict
Line = tuple[Mark, ...]


@dataclass(frozen=True)
class Paragraph:
    line: Line
    anchor: str | None = None


@dataclass(frozen=True)
class Bullets:
    items: tuple[Paragraph, ...]


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[Mark, ...], ...]
    anchor: str | None = None
    prose: tuple[str, ...] = ()  # columns of sentences rather than figures


@dataclass(frozen=True)
class Warnings:
    texts: tuple[str, ...]


@dataclass(frozen=True)
class Charts:
    files: tuple[tuple[str, str], ...]  # (name, file name beside report.json)


Block = Paragraph | Bullets | Table | Warnings | Charts


@dataclass(frozen=True)
class Section:
    title: str | None  # None: the report's opening, under the report's own title
    blocks: tuple[Block, ...]


@dataclass(frozen=True)
class ReportView:
    title: Line
    sections: tuple[Section, ...]
