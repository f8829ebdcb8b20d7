"""bench/results.py: figures saved with their machine, and the benchmarks page's table regenerated from them."""

from __future__ import annotations

import json

from bench import results

PAGE = f"""# Benchmarks

Intro.

{results.BEGIN}
Latest runs: none in bench-results/ yet.

{results.HEADER}
| prepare: an old figure | 0.5x | >= 0.9x |
| launcher: by hand vs launcher | 0.97x | <= 1.15x |
| gpu check: GPT-2 124M | not run | MFU >= 40% |
{results.END}

After the table.
"""


def test_saved_figures_carry_the_machine_and_land_in_the_history(tmp_path):
    machine = results.machine()
    assert machine["usable_cores"] >= 1 and machine["logical_cores"] >= machine["usable_cores"]
    assert machine["cpu"] and machine["python"] and "numpy" in machine["packages"]
    latest = results.save("prepare", {"rows": [], "ratio": 0.93}, machine, tmp_path)
    record = json.loads(latest.read_text())
    assert record["benchmark"] == "prepare" and record["ratio"] == 0.93 and record["machine"] == machine
    history = list((tmp_path / "history").glob("*-prepare.json"))
    assert len(history) == 1 and json.loads(history[0].read_text()) == record


def test_the_table_shows_the_latest_rows_and_keeps_benchmarks_without_results(tmp_path):
    page = tmp_path / "benchmarks.md"
    page.write_text(PAGE)
    machine = results.machine() | {"cpu": "Test CPU", "usable_cores": 2, "logical_cores": 4, "gpus": []}
    results.save("prepare", {"rows": [
        {"benchmark": "prepare: stage vs raw, 1 core", "measured": "0.95x", "target": ">= 0.9x"},
        {"benchmark": "prepare: stage vs raw, 2 cores", "measured": "0.88x", "target": ">= 0.85x"},
    ]}, machine, tmp_path)
    results.save("trainer", {"rows": [{"benchmark": "trainer: vs model.fit", "measured": "0.97x",
                                       "target": ">= 0.95x"}]}, machine, tmp_path)

    assert results.update_page(page, tmp_path)
    text = page.read_text()
    table = text[text.index(results.BEGIN):text.index(results.END)]
    lines = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert lines == [
        "| prepare: stage vs raw, 1 core | 0.95x | >= 0.9x |",
        "| prepare: stage vs raw, 2 cores | 0.88x | >= 0.85x |",
        "| trainer: vs model.fit | 0.97x | >= 0.95x |",
        "| launcher: by hand vs launcher | 0.97x | <= 1.15x |",  # no results file: the page's row stays
        "| gpu check: GPT-2 124M | not run | MFU >= 40% |",
    ]
    assert "`prepare` " in table and "2 of 4 cores of Test CPU" in table and "0.5x" not in table
    assert text.startswith("# Benchmarks\n\nIntro.\n\n") and text.endswith(f"{results.END}\n\nAfter the table.\n")
    assert not results.update_page(page, tmp_path)  # regenerating again changes nothing


def test_the_benchmarks_page_shows_the_table_of_the_committed_results():
    """docs/benchmarks.md holds the table `make bench-table` makes from bench-results/: nobody edited it by hand,
    and no results file is newer than the page."""
    page = results.PAGE.read_text()
    assert page.count(results.BEGIN) == 1 and page.count(results.END) == 1
    assert results.table(page) == page[page.index(results.BEGIN):page.index(results.END) + len(results.END)]
