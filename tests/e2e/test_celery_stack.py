"""What tests/support/celery_stack.py says when it cannot run: a component that exits during start-up is named with its
command and the last lines of its log; a machine without PostgreSQL or Redis skips the Celery tests naming the
command that installs them. (The stack itself runs in tests/e2e/test_celery_pipeline.py.)"""

from __future__ import annotations

import os

import pytest

from tests.support import celery_stack
from tests.support.celery_stack import LOG_TAIL_LINES, Component, ComponentStartError, wait_until_ready


def test_a_component_that_exits_during_start_up_is_named_with_its_command_and_log_tail(tmp_path):
    script = "for i in $(seq 1 60); do echo log line $i; done; exit 3"
    component = Component("broken-worker", ["bash", "-c", script], dict(os.environ), tmp_path / "broken.log",
                          is_ready=lambda _: False)
    component.start()
    with pytest.raises(ComponentStartError) as raised:
        wait_until_ready([component], timeout=30)
    message = str(raised.value)
    assert message.startswith("broken-worker exited with 3 during start-up.")
    assert f"command: bash -c '{script}'" in message
    assert message.endswith("\n".join(f"log line {i}" for i in range(61 - LOG_TAIL_LINES, 61)))
    assert f"log line {60 - LOG_TAIL_LINES}\n" not in message


def test_a_component_never_ready_is_named_with_the_others_still_starting(tmp_path):
    slow = [Component(name, ["sleep", "30"], dict(os.environ), tmp_path / f"{name}.log", is_ready=lambda _: False)
            for name in ("scheduler", "triggerer")]
    for component in slow:
        component.start()
    try:
        with pytest.raises(ComponentStartError, match=r"^scheduler was not ready within 2s \(nor triggerer\)"):
            wait_until_ready(slow, timeout=2)
    finally:
        celery_stack.end_process_groups([component.process for component in slow], grace_s=1)


@pytest.mark.parametrize("missing", [{"initdb"}, {"redis-server"}, {"initdb", "redis-server"}])
def test_missing_servers_are_named_with_the_command_that_installs_them(monkeypatch, missing):
    monkeypatch.setattr(celery_stack, "postgres_tool", lambda name: None if name in missing else "/bin/true")
    monkeypatch.setattr(celery_stack.shutil, "which", lambda name: None if name in missing else "/bin/true")
    reason = celery_stack.unavailable_reason()
    named = [what for what, tool in (("PostgreSQL", "initdb"), ("redis-server", "redis-server")) if tool in missing]
    assert reason.startswith(f"{' and '.join(named)} not installed, needed by the Celery stack: ")
    assert "run `make provision` as root, or `apt-get install -y postgresql redis-server`" in reason
