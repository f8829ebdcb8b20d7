"""The headless Chromium the browser tests drive, found where scripts/provision-tests.sh installs it."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


def install_command() -> str:
    """The one command that installs a browser here (scripts/provision-tests.sh names the same one)."""
    if shutil.which("apt-get"):
        return f"{'' if os.geteuid() == 0 else 'sudo '}apt-get install -y chromium"
    return ".venv/bin/python -m playwright install chromium"


@contextlib.contextmanager
def chromium():
    """A launched headless Chromium: Debian's on PATH, else Playwright's own build; skips the test when neither is
    installed, naming the command that installs one."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        executable = shutil.which("chromium")
        if executable is None and not os.path.exists(playwright.chromium.executable_path):
            pytest.skip(f"no Chromium for the browser tests (none on PATH, no Playwright build): {install_command()}")
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
