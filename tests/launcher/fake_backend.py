"""A backend whose workers are scripts, not processes: the supervisor's timing paths run in milliseconds.

Each rank follows a list of steps: `("line", text)` prints a line, `("ready",)` prints the ready marker,
`("sleep", s)` waits, `("exit", code)` ends the worker, `("hang",)` blocks until it is terminated or killed.
`ignore_term` makes terminate a no-op (only kill ends it), as a rank blocked in a collective meets SIGTERM;
`ignore_abort` does the same to abort (the launcher's ABORT_SIGNAL), as a rank writing a checkpoint holds it back.
Scripts can differ per launch attempt.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from core.protocol import READY_MARKER
from launcher.backend import Backend, HostRelease, ReleaseResult, WorkerHandle
from launcher.spec import GroupSpec, Placement, WorkerSpec

Script = Sequence[tuple]


class _Output:
    def __init__(self) -> None:
        self.lines: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self.closed = False
        self._pending = b""

    def readline(self, size: int = -1) -> bytes:
        """As a pipe's readline: at most `size` bytes, the rest of a longer line on the next call."""
        line, self._pending = (self._pending, b"") if self._pending else (self.lines.get(), b"")
        if 0 <= size < len(line):
            line, self._pending = line[:size], line[size:]
        return line

    def close(self) -> None:
        self.closed = True


class FakeHandle(WorkerHandle):
    def __init__(self, rank: int, host: str, script: Script, ignored: frozenset[str]) -> None:
        self.rank, self.host, self.pid = rank, host, 1000 + rank
        self._output = _Output()
        self._exit: int | None = None
        self._stopped = threading.Event()
        self.ignored = ignored  # of "TERM", "ABORT"
        self.signals: list[str] = []
        threading.Thread(target=self._play, args=(script,), daemon=True).start()

    def _play(self, script: Script) -> None:
        for step in script:
            if self._stopped.is_set():
                return
            kind = step[0]
            if kind == "line":
                self._output.lines.put(step[1].encode() + b"\n")
            elif kind == "ready":
                self._output.lines.put(f"{READY_MARKER} rank={self.rank}\n".encode())
            elif kind == "sleep":
                self._stopped.wait(step[1])
            elif kind == "hang":
                self._stopped.wait()
                return
            elif kind == "exit":
                self._end(step[1])
                return
        self._end(0)

    def _end(self, code: int) -> None:
        if self._exit is None:
            self._exit = code
            self._stopped.set()
            self._output.lines.put(b"")

    @property
    def output(self):
        return self._output

    def poll(self) -> int | None:
        return self._exit

    def terminate(self) -> None:
        self.signals.append("TERM")
        if "TERM" not in self.ignored:
            self._end(-15)

    def abort(self) -> None:
        self.signals.append("ABORT")
        if "ABORT" not in self.ignored:
            self._end(-10)

    def kill(self) -> None:
        self.signals.append("KILL")
        self._end(-9)

    def gone(self) -> bool:
        return self._exit is not None

    def record(self) -> dict[str, Any]:
        return {"fake_pid": self.pid}


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, scripts: Callable[[int, int], Script] | Mapping[int, Script], *,
                 ignore_term: Sequence[int] = (), ignore_abort: Sequence[int] = (),
                 earlier: Sequence[dict[str, Any]] = ()) -> None:
        """`scripts(attempt, rank)` (or a mapping rank -> script for every attempt); `earlier`: what
        `end_earlier_attempts` reports (hosts where an earlier attempt left workers)."""
        self.scripts = scripts if callable(scripts) else (lambda attempt, rank: scripts[rank])
        self.ignore_term, self.ignore_abort = set(ignore_term), set(ignore_abort)
        self.earlier = list(earlier)
        self.earlier_asked: list[str] = []
        self.attempt = 0
        self.handles: list[FakeHandle] = []
        self.envs: list[dict[str, str]] = []
        self.ended_groups = 0
        self._next_port = 20000

    def place(self, group: GroupSpec) -> list[Placement]:
        self.attempt += 1
        placements = [Placement(f"fake-host-{rank}", self._next_port + rank, ()) for rank in range(group.num_workers)]
        self._next_port += group.num_workers
        return placements

    def command(self, group: GroupSpec) -> list[str]:
        return ["fake-python", "-m", group.entrypoint, *group.args]

    def start(self, group: GroupSpec, worker: WorkerSpec, command: list[str], env: Mapping[str, str]) -> FakeHandle:
        self.envs.append({**env, **group.secret_env})
        ignored = frozenset({"TERM"} if worker.rank in self.ignore_term else set()) | frozenset(
            {"ABORT"} if worker.rank in self.ignore_abort else set())
        handle = FakeHandle(worker.rank, worker.host, self.scripts(self.attempt, worker.rank), ignored)
        self.handles.append(handle)
        return handle

    def end_group(self, group: GroupSpec) -> None:
        self.ended_groups += 1

    def end_earlier_attempts(self, group: GroupSpec) -> list[HostRelease]:
        self.earlier_asked.append(group.name)
        return [HostRelease.of(entry["host"], entry) for entry in self.earlier]

    def release(self, run_key: str, records: list[dict[str, Any]], grace_s: float = 10.0) -> ReleaseResult:
        return ReleaseResult(self.name, (), clean=True)
