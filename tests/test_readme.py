"""The README stays current: its two commands exist, and its settings table lists every run setting."""

import re
import subprocess
from pathlib import Path

from trainer.config import field_names

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_settings_table_lists_every_setting_exactly_once():
    rows = re.findall(r"^\| `(\w+)` \|", README, flags=re.MULTILINE)
    assert sorted(rows) == sorted(field_names())


def test_readme_commands_are_make_targets():
    for target in re.findall(r"^make (\w[\w-]*)", README, flags=re.MULTILINE):
        dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=False)
        assert dry.returncode == 0, f"`make {target}` from the README fails: {dry.stderr}"


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert "make test" in (REPO / ".ci" / "run").read_text()
