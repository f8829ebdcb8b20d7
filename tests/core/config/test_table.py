"""docs/settings.md's table is the one `core.config.table` writes from RunConfig's declarations."""

from core.config import SETTINGS
from core.config.table import PAGE, allowed, page_with_table, table


def test_the_page_holds_the_table_the_declarations_write():
    page = PAGE.read_text()
    assert page_with_table(page) == page, "docs/settings.md is stale: run `python -m core.config.table`"
    assert len(table().splitlines()) == len(SETTINGS) + 2


def test_allowed_says_bounds_choices_and_the_declarations_note():
    by_name = {s.name: s for s in SETTINGS}
    assert allowed(by_name["num_workers"]) == "1–64"
    assert allowed(by_name["epochs"]) == "(0, 1000]"
    assert allowed(by_name["weight_decay"]) == "[0, 1]"
    assert allowed(by_name["promote"]) == "`auto`, `always`, `never`"
    assert allowed(by_name["warmup_steps"]) == "0–10,000,000; below `max_steps`"
    assert allowed(by_name["storage_conn_id"]) == "at most 253 characters"
