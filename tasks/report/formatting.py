"""How the reports write their figures, for every reader (report.md, the task log, the UI's pages): the table's
columns, the notes, and numbers as text. A leaf: it imports nothing of the project."""

from __future__ import annotations

import math
from typing import Any

TABLE_COLUMNS = ("run", "workers", "train time", "eval time", "tokens/s", "speedup", "efficiency", "eval loss",
                 "perplexity", "nats/char", "known words")
KNOWN_WORDS_NOTE = ("Known words: the share of the words in the model's greedy / top-k samples that occur in the "
                    "training text; nats/char: eval loss per character of validation text, whatever the tokenizer")


def fmt(value: Any, spec: str = ".3f", suffix: str = "", scale: float = 1) -> str:
    """A figure (times `scale`) for people; missing or non-finite values read as an em dash rather than 'None' or
    'nan'. A value that is no number (a report.json someone else wrote) reads as it is: the UI escapes it."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    if not isinstance(value, (int, float)):
        return str(value)
    try:
        return f"{value * scale:{spec}}{suffix}"
    except OverflowError:  # an integer beyond float range (`,.0f` converts it)
        return "—"


def nats(delta: Any) -> str:
    """A loss difference: 4 decimals, or scientific notation when it is too small for them (not '-0.0000')."""
    if not isinstance(delta, (int, float)) or not math.isfinite(delta):
        return fmt(delta)
    return f"{delta:+.4f}" if delta == 0 or abs(delta) >= 5e-5 else f"{delta:+.2e}"


def known_words(figures: Any) -> str:
    """`greedy / top-k` known-word rates as percentages ('—' where a model's samples were not scored)."""
    figures = figures if isinstance(figures, dict) else {}
    return " / ".join(fmt(figures.get(mode), ".0f", "%", scale=100) for mode in ("greedy", "top_k"))
