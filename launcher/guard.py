"""The local backend's guard: it ends a launch attempt's workers when the launcher that started them is gone.

Each worker runs in a session of its own (so that its whole process group can be stopped), which also means that
nothing ends it when the launcher dies without running its cleanup: an Airflow task runner killed by SIGKILL or by
the OOM killer runs no `on_kill` and no `finally`. So the local backend starts this small process before the
attempt's first worker, in its own session too, with a pipe on its stdin whose write end only the launcher holds.
The kernel closes that end however the launcher ends; the guard then reads EOF and ends every process that carries
the attempt's token in its environment (`GUARD_ENV`: the workers, their children, also those that left the
worker's process group), TERM, `ORPHAN_GRACE_S`, KILL. At the end of a normal attempt the launcher closes the pipe
itself once the workers are gone, and the guard finds nothing left to end.

    python -m launcher.guard <token> <grace_s>

Stdlib only, no Airflow, no TensorFlow. What it ended goes to stderr (the launcher points it at a file).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from launcher.process import GUARD_ENV, end_marked_processes

# A worker forked just before the launcher died may not carry the token yet when the first scan runs: scan again.
RESCAN_AFTER_S = 0.5


class _Stop(Exception):
    """SIGTERM reached the guard: nothing would guard the workers afterwards, so it ends them first."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop


def wait_for_launcher(fd: int = 0) -> str:
    """Block until the launcher's end of the pipe closes (EOF) or SIGTERM arrives; returns which."""
    try:
        while os.read(fd, 4096):
            pass  # the launcher writes nothing: any byte is ignored
    except _Stop:
        return "SIGTERM"
    except OSError:
        pass  # a broken stdin counts as the launcher being gone
    return "launcher gone"


def end_workers(token: str, grace_s: float) -> list[dict]:
    """End every process carrying the token; scan once more shortly after, for one that was still starting."""
    rounds = []
    for attempt in range(2):
        if attempt:
            time.sleep(RESCAN_AFTER_S)
        ended = end_marked_processes({GUARD_ENV: token}, grace_s)
        if ended["found"]:
            rounds.append(ended)
    return rounds


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m launcher.guard <token> <grace_s>", file=sys.stderr)
        return 2
    token, grace_s = argv[0], float(argv[1])
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closing terminal is not the launcher's death
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # nor is Ctrl-C in the launcher's terminal: the launcher handles it
    why = wait_for_launcher()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the workers must be ended now, whatever else arrives
    for ended in end_workers(token, grace_s):
        print(f"guard {token}: {why}: ended {json.dumps(ended)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
