"""What a failed rank's record says (`WorkerFailure`): its kind, and a detail that names the cause and the setting to
change. Pure functions of what the group's watch loop saw (launcher/group.py decides when a rank has failed)."""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence

from launcher.spec import FailureKind, WorkerFailure, WorkerSpec

# What TensorFlow's gRPC server (and Python's socket) print when the port was taken before the worker bound it.
BIND_FAILURE = re.compile(r"address already in use|could not start grpc server|failed to add port|EADDRINUSE",
                          re.IGNORECASE)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def exit_failure(worker: WorkerSpec, pid: int | None, code: int, elapsed: float, tail: tuple[str, ...], *,
                 joined: bool) -> WorkerFailure:
    """The rank exited with `code` (negative: by that signal); before `joined`, a bind error in its tail is a taken
    port, which the group relaunches on new ports."""
    kind = FailureKind.SIGNAL if code < 0 else FailureKind.EXIT_CODE
    detail = describe_exit(code)
    if not joined and any(BIND_FAILURE.search(line) for line in tail):
        kind = FailureKind.PORT_BIND
        detail += f" before joining the group: port {worker.port} was already in use"
    return WorkerFailure(worker.rank, worker.host, pid, kind, code, elapsed, detail, tail)


def startup_failure(worker: WorkerSpec, pid: int | None, elapsed: float, tail: tuple[str, ...], *, timeout_s: float,
                    joined: Sequence[int], waiting: str) -> WorkerFailure:
    """The rank never printed its ready marker within `timeout_s`; `joined`: the ranks that did; `waiting`: why it
    never started, as its backend says (a Pending pod), or ""."""
    detail = (
        f"did not join the group within startup_timeout_s={timeout_s:g} s "
        f"({f'never started: {waiting}' if waiting else 'still running'}, its address {worker.address}; "
        f"ranks that joined: {list(joined) or 'none'}). "
        "Likely causes: the worker is stuck before creating its strategy, an unreachable address or a closed "
        "port in TF_CONFIG, a firewall, or a peer that never came up. Raise startup_timeout_s if start-up is "
        "legitimately slow."
    )
    return WorkerFailure(worker.rank, worker.host, pid, FailureKind.STARTUP_TIMEOUT, None, elapsed, detail, tail)


def hang_failure(worker: WorkerSpec, pid: int | None, elapsed: float, tail: tuple[str, ...], *, timeout_s: float,
                 silent_s: float) -> WorkerFailure:
    """The rank was alive but the whole group printed nothing for `silent_s`, past `timeout_s`."""
    detail = (
        f"was alive but the whole group printed nothing for {silent_s:.0f} s "
        f"(hang_timeout_s={timeout_s:g}): a hung collective, usually a peer that stopped "
        "taking part. Raise hang_timeout_s if a step legitimately takes longer."
    )
    return WorkerFailure(worker.rank, worker.host, pid, FailureKind.HANG, None, elapsed, detail, tail)
