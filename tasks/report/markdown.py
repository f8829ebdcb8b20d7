"""report.md: the report's view (tasks/report/view.py) written as Markdown."""

from __future__ import annotations

from tasks.report import blocks


def markdown(view: blocks.ReportView) -> str:
    """Blocks separated by one blank line; every line of text stays on one line of Markdown."""
    blocks = [f"# {_line(view.title)}"]
    for section in view.sections:
        blocks += [f"## {section.title}"] if section.title else []
        blocks += [text for block in section.blocks for text in _block(block)]
    return "\n\n".join(blocks) + "\n"


def _block(block: blocks.Block) -> list[str]:
    if isinstance(block, blocks.Paragraph):
        return [_line(block.line)]
    if isinstance(block, blocks.Bullets):
        return ["\n".join(f"- {_line(item.line)}" for item in block.items)]
    if isinstance(block, blocks.Warnings):
        return [f"> **Warning:** {_one_line(text)}" for text in block.texts]
    if isinstance(block, blocks.Charts):
        return ["\n".join(f"![{name}]({file})" for name, file in block.files)]
    return [_table(block)]


def _table(table: blocks.Table) -> str:
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "|".join("---" for _ in table.columns) + "|"]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in table.rows]
    return "\n".join(lines)


def _line(line: blocks.Line) -> str:
    return _one_line("".join(_mark(mark) for mark in line))


def _mark(mark: blocks.Mark) -> str:
    if isinstance(mark, blocks.Emphasis):
        return f"**{mark.text}**"
    if isinstance(mark, blocks.Code):
        return f"`{mark.text}`"
    if isinstance(mark, blocks.Verdict):
        return f"**{mark.label}: {mark.text}**" if mark.label else f"**{mark.text}**"
    return mark


def _cell(mark: blocks.Mark) -> str:
    """A pipe would split the cell: Markdown shows `\\|` as `|`."""
    return _one_line(_mark(mark)).replace("|", "\\|")


def _one_line(text: str) -> str:
    """A line break would end a table row, a list item or a paragraph's line."""
    return " ".join(text.split())
