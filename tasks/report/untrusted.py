"""Reading a JSON record that another task or run wrote (a report.json, a release.json) as untrusted input: a size
limit checked before reading, a nesting limit checked after parsing (linear, iterative), and one error type for all
of it, so a reader can show "unreadable" instead of failing (the UI's index, evaluate's history of earlier runs).
A leaf: storage access through core.storage only."""

from __future__ import annotations

import json
import math
from typing import Any

from core.storage import filesystem

MAX_RECORD_BYTES = 16 << 20  # a report with its samples is well under 1 MB
MAX_DEPTH = 32  # a report nests 5 levels deep


class UnreadableRecord(ValueError):
    """A record that is too large, not JSON, or nested too deep; the message names the file, `reason` says what
    is wrong without it (for pages that name no storage URL)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.reason = reason


def read_record(url: str, *, max_bytes: int | None = None, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value stored at `url`; UnreadableRecord when it is over `max_bytes` (default MAX_RECORD_BYTES), no
    JSON (or not UTF-8), or nested deeper than `max_depth`. FileNotFoundError as the storage raises it."""
    max_bytes = MAX_RECORD_BYTES if max_bytes is None else max_bytes
    fs, path = filesystem(url)
    size = fs.size(path)
    if size is not None and size > max_bytes:
        raise UnreadableRecord(url, f"too large: {size} bytes, over the {max_bytes} a record may have")
    data = fs.cat_file(path, start=0, end=max_bytes + 1)  # one request: one version, while a writer replaces it
    if len(data) > max_bytes:
        raise UnreadableRecord(url, f"too large: over the {max_bytes} bytes a record may have")
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise UnreadableRecord(url, "nested too deep") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
        raise UnreadableRecord(url, "not valid JSON") from error
    if depth(value) > max_depth:
        raise UnreadableRecord(url, f"nested too deep: more than {max_depth} levels")
    return value


def depth(value: Any) -> int:
    """How deeply lists and dicts nest in `value` (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level + 1)
            stack += [(child, level + 1) for child in item if isinstance(child, (dict, list))]
    return deepest


def finite(value: Any) -> bool:
    """A number a report may carry: int or float (not bool), finite, within float range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond float range
        return False
