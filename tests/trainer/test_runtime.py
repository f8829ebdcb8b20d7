"""How a worker process meets SIGTERM (trainer/runtime.py), in a fresh interpreter without TensorFlow."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

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
