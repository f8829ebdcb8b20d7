"""docs/settings.md's table of run settings, written from their declarations (`RunConfig`'s fields).

`python -m core.config.table` rewrites the table in docs/settings.md between its two markers; a test
(tests/core/config/test_table.py) fails when the page and the declarations disagree.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from core import REPO_ROOT
from core.config import SETTINGS
from core.config.schema import Setting, thawed

PAGE = REPO_ROOT / "docs" / "settings.md"
BEGIN = "<!-- settings table: written by `python -m core.config.table` from RunConfig's declarations -->"
END = "<!-- end of the settings table -->"
_HEADER = "| setting | section | type | default | allowed | meaning |\n|---|---|---|---|---|---|"
_KINDS = {"array": "list", "object": "object"}


def table(settings: tuple[Setting, ...] = SETTINGS) -> str:
    """The Markdown table, one row per setting in the trigger form's order."""
    rows = (f"| `{s.name}` | {s.section or 'core'} | {_kind(s)} | {_default(s.default)} | {_cell(allowed(s))} | "
            f"{_cell(meaning(s))} |" for s in settings)
    return "\n".join((_HEADER, *rows))


def meaning(setting: Setting) -> str:
    """The form's help text, with the link to the docs section that explains the setting."""
    return " ".join(part for part in (setting.description, f"(see {setting.see})" if setting.see else "") if part)


def allowed(setting: Setting) -> str:
    """What the declaration allows, in words: its bounds or choices, then the note its declaration adds."""
    rules = setting.rules
    words = []
    if "enum" in rules or "enum" in rules.get("items", {}):
        choices = rules.get("enum") or rules["items"]["enum"]
        words.append(", ".join(f"`{choice}`" for choice in choices) + (", each once" if rules.get("uniqueItems")
                                                                         else ""))
    if "maximum" in rules:
        words.append(_range(setting))
    if "maxLength" in rules and not setting.allowed:
        words.append(f"at most {rules['maxLength']:,} characters")
    if setting.allowed:
        words.append(setting.allowed)
    return "; ".join(words)


def _range(setting: Setting) -> str:
    rules = setting.rules
    high = _number(rules["maximum"])
    if "exclusiveMinimum" in rules:
        return f"({_number(rules['exclusiveMinimum'])}, {high}]"
    low = _number(rules["minimum"])
    return f"[{low}, {high}]" if setting.type == "number" else f"{low}–{high}"


def _number(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) and value >= 10_000 else f"{value:g}"


def _kind(setting: Setting) -> str:
    items = setting.rules.get("items", {}).get("type")
    kind = f"list of {items}s" if setting.type == "array" and items else _KINDS.get(setting.type, setting.type)
    return f"{kind} or empty" if setting.optional and setting.default is None else kind


def _default(value: Any) -> str:
    if value in ("", None):
        return "empty"
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(thawed(value))}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def page_with_table(page: str) -> str:
    """`page` with the text between its markers replaced by the table."""
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{PAGE} lacks the markers of the settings table: {BEGIN!r} ... {END!r}")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main(page: Path = PAGE) -> int:
    page.write_text(page_with_table(page.read_text()))
    print(f"wrote the table of {len(SETTINGS)} settings into {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
