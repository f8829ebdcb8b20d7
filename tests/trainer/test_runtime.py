"""How a worker process meets SIGTERM (trainer/runtime.py), in a fresh interpreter without TensorFlow."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from core.protocol import ABORT_SIGNAL
from tests.conftest import REPO

WORKER = textwrap.dedent("""
    import os, signal, sys, time
    from trainer import runtime
    runtime.end_on_sigterm()
    with runtime.writing_checkpoint():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        open(sys.argv[1], "w").write("complete")
    open(sys.argv[1], "a").write(" and past the block")
""")


def test_sigterm_while_writing_a_checkpoint_ends_the_worker_right_after_it(tmp_path):
    marker = tmp_path / "checkpoint"
    worker = subprocess.run([sys.executable, "-c", WORKER, str(marker)], cwd=REPO, timeout=60, check=False)
    assert worker.returncode == -signal.SIGTERM
    assert marker.read_text() == "complete"


ABORTED_WORKER = textwrap.dedent("""
    import os, sys, threading, time
    from core.protocol import ABORT_SIGNAL
    from trainer import runtime
    runtime.end_on_sigterm()
    with runtime.preemption_notices(30):
        with runtime.writing_checkpoint():
            os.kill(os.getpid(), ABORT_SIGNAL)
            time.sleep(0.2)
            open(sys.argv[1], "w").write("complete")
        open(sys.argv[1], "a").write(" and past the block")
""")

# A rank whose peer died waits in the next step's collective, which never returns: a lock that nobody releases stands
# in for it. SIGTERM there is a preemption notice for a next step that never comes; ABORT_SIGNAL ends it.
BLOCKED_WORKER = textwrap.dedent("""
    import os, signal, sys, threading
    from trainer import runtime
    runtime.end_on_sigterm()
    with runtime.preemption_notices(30):
        print("blocked", flush=True)
        lock = threading.Lock(); lock.acquire(); lock.acquire()
""")


def test_the_abort_signal_while_writing_a_checkpoint_ends_the_worker_right_after_it(tmp_path):
    marker = tmp_path / "checkpoint"
    worker = subprocess.run([sys.executable, "-c", ABORTED_WORKER, str(marker)], cwd=REPO, timeout=60, check=False)
    assert worker.returncode == -ABORT_SIGNAL
    assert marker.read_text() == "complete"


def test_a_worker_blocked_in_native_code_ends_at_once_on_the_abort_signal_but_not_on_sigterm(tmp_path):
    worker = subprocess.Popen([sys.executable, "-c", BLOCKED_WORKER], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert worker.stdout.readline() == b"blocked\n"
        worker.send_signal(signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(1.0)  # a preemption notice: the loop would act on it at its next step
        sent = time.monotonic()
        worker.send_signal(ABORT_SIGNAL)
        assert worker.wait(5) == -ABORT_SIGNAL and time.monotonic() - sent < 1
    finally:
        worker.kill()
        worker.wait()
