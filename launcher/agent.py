"""The agent the SSH backend runs on each remote host: `<remote_python> -u -m launcher.agent MODE`.

Every mode reads one JSON line on stdin (so secrets never travel in an argv or an SSH exec string) and answers on
stdout: `run` starts a worker and relays its output between control lines; `probe`, `release`, `kill`, `reap`,
`slots` and `utilization` answer with one JSON object. The modes, their requests and answers are specified in
docs/CONTRACTS.md ("SSH backend <-> remote agent"); the fields each request must have, and what they must be, are
typed in `launcher.agent_requests`; the control lines are named in `core.protocol`. It runs from the launcher
package installed in `remote_python`'s environment on that host, and imports neither Airflow nor TensorFlow: it
starts for every rank, so it must start fast (pydantic, which checks the requests, is its one import beside the
standard library).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from core.protocol import (
    ABORT_LINE,
    ABORT_SIGNAL,
    AGENT_LINE,
    AGENT_MODULE,
    EXIT_LINE,
    GROUP_ENV,
    RUN_KEY_ENV,
    STOP_LINE,
    control_line,
    inherited_environment,
)
from launcher.agent_requests import REQUESTS, BadRequest, checked_request
from launcher.gpus import (
    check_exited_slots,
    gpu_utilization,
    probe_gpus,
    release_check,
    release_is_clean,
    watch_release,
)
from launcher.host_probe import package_versions
from launcher.local import PortAllocator
from launcher.process import (
    KILL_WAIT_S,
    ORPHAN_GRACE_S,
    code_to_exit_status,
    end_marked_processes,
    live_group_members,
    processes_with_env,
    signal_group,
    stop_group,
    wait_group_gone,
)
from launcher.tf_env import worker_temp_environment

EXIT_BAD_REQUEST = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EVERY_INTERFACE = "0.0.0.0"  # where a probe's ports must be free: TensorFlow's worker server binds them all
MAX_LINE_BYTES = 1 << 16  # a worker line longer than this is relayed in pieces
OUTPUT_DRAIN_S = 2.0  # how long the relay may lag once the worker's group is gone (an escaped process holds it)


def host_path(path: str) -> Path:
    """A path on this host: `~` expanded, and a relative one under this host's temporary directory ($TMPDIR or
    /tmp here), so the launcher can name a per-host location without knowing the host's layout."""
    expanded = Path(path).expanduser()
    return expanded if expanded.is_absolute() else Path(tempfile.gettempdir()) / expanded


def read_request(stream: IO[bytes], mode: str) -> dict[str, Any]:
    """The one JSON line of a request, checked field by field. Messages name fields, never values (secrets)."""
    line = stream.readline()
    if not line.strip():
        raise BadRequest(f"no {mode} request: stdin closed before a JSON line arrived")
    try:
        request = json.loads(line)
    except ValueError as error:  # the message holds a position, not the text
        raise BadRequest(f"the {mode} request is not one JSON object: {getattr(error, 'msg', error)}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"the {mode} request must be a JSON object")
    if mode == "run":
        request.setdefault("base_env", "inherit")
    return checked_request(mode, request)


def identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "python": "{}.{}.{}".format(*sys.version_info[:3]),
            "executable": sys.executable, "versions": package_versions()}


class Output:
    """Our stdout, written by the relay and the control lines alike: whole lines, flushed, and silently dropped once
    the reader is gone (the worker is being stopped then; its output must still be drained)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.lock = threading.Lock()
        self.broken = False
        self.at_line_start = True

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.broken or not data:
                return
            try:
                self.stream.write(data)
                self.stream.flush()
            except OSError:  # BrokenPipeError: the SSH channel is closed
                self.broken = True
            self.at_line_start = data.endswith(b"\n")

    def control(self, tag: str, payload: dict[str, Any]) -> None:
        prefix = b"" if self.at_line_start else b"\n"  # a worker's unterminated last line stays its own line
        self.write(prefix + control_line(tag, payload))


def _relay(source: IO[bytes], out: Output) -> None:
    for chunk in iter(lambda: source.readline(MAX_LINE_BYTES), b""):
        out.write(chunk)


class StopRequest:
    """Why the worker must stop, once `event` is set: `asked` when the launcher wrote `STOP_LINE` or `ABORT_LINE`
    first, `aborted` when it was `ABORT_LINE` (another rank failed: the first signal is ABORT_SIGNAL)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.asked = False
        self.aborted = False

    def grace_s(self, requested: float) -> float:
        return requested if self.asked else min(requested, ORPHAN_GRACE_S)

    @property
    def first_signal(self) -> signal.Signals:
        return ABORT_SIGNAL if self.aborted else signal.SIGTERM


def _watch_stdin(stdin: IO[bytes], stop: StopRequest) -> None:
    """Sets `stop` when stdin reaches EOF: sshd closes it when the channel closes or the connection drops."""
    seen = b""
    window = max(len(STOP_LINE), len(ABORT_LINE))
    try:
        while chunk := stdin.read1(MAX_LINE_BYTES):
            seen = (seen + chunk)[-window:]  # nothing else is expected after the request
            stop.aborted = stop.aborted or seen.endswith(ABORT_LINE)
            stop.asked = stop.asked or stop.aborted or seen.endswith(STOP_LINE)
    except (OSError, ValueError):
        pass
    stop.event.set()


def run_worker(request: dict[str, Any], out: Output, stdin: IO[bytes]) -> int:
    argv, cwd, grace_s = request["argv"], str(host_path(request["cwd"])), float(request["grace_s"])
    stop = StopRequest()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.event.set())
    try:
        os.makedirs(cwd, mode=0o700, exist_ok=True)
        temp_env = worker_temp_environment(cwd)  # removed with the run's directory at release
    except OSError as error:
        out.control(EXIT_LINE, {"code": EXIT_NOT_EXECUTABLE,
                                "error": f"cannot create the working directory {cwd}: {error.strerror}"})
        return EXIT_NOT_EXECUTABLE
    try:
        worker = subprocess.Popen(
            argv, cwd=cwd, env={**inherited_environment(os.environ), **request["env"], **temp_env},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as error:
        code = EXIT_NOT_FOUND if isinstance(error, FileNotFoundError) else EXIT_NOT_EXECUTABLE
        out.control(EXIT_LINE, {"code": code, "error": f"cannot start {argv[0]!r}: {error.strerror}"})
        return code
    pgid = worker.pid  # start_new_session: the worker leads its own group
    out.control(AGENT_LINE, {"pid": worker.pid, "pgid": pgid, **identity()})

    relay = threading.Thread(target=_relay, args=(worker.stdout, out), name="relay", daemon=True)
    relay.start()
    threading.Thread(target=_watch_stdin, args=(stdin, stop), name="stdin", daemon=True).start()
    threading.Thread(target=lambda: stop.event.wait() and stop_group(pgid, stop.grace_s(grace_s), stop.first_signal),
                     name="stop", daemon=True).start()

    code = worker.wait()  # a signal runs its handler (stop.event.set) and the wait resumes
    # What it left in its group.
    stop_group(pgid, stop.grace_s(grace_s) if stop.event.is_set() else grace_s, stop.first_signal)
    relay.join(OUTPUT_DRAIN_S)
    out.control(EXIT_LINE, {"code": code})
    return code_to_exit_status(code)


def _workdir_status(workdir: str) -> dict[str, Any]:
    path = host_path(workdir)
    status: dict[str, Any] = {"workdir": str(path), "workdir_writable": False, "workdir_error": None,
                              "free_disk_bytes": None}
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tfmw-probe-"):
            pass
        status["workdir_writable"] = True
    except OSError as error:
        status["workdir_error"] = f"{type(error).__name__}: {error.strerror or error}"
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None:
        status["free_disk_bytes"] = shutil.disk_usage(existing).free
    return status


def gpu_inventory() -> dict[str, Any]:
    """NVML's view of this host: {"nvml", "count", "free": indices of free GPUs, "pin": how to pin each free GPU
    (its UUID, else its index), "idle_mb": each free GPU's idle level by that name, "left_out": the GPUs that are not
    free and why}."""
    gpus = probe_gpus()
    if gpus.unavailable:
        return {"nvml": False, "count": 0, "free": [], "pin": [], "left_out": [], "unavailable": gpus.unavailable}
    return {"nvml": True, "count": len(gpus.free) + len(gpus.left_out), "free": gpus.free_indices,
            "pin": [gpu.uuid or gpu.index for gpu in gpus.free],
            "idle_mb": {str(gpu.uuid or gpu.index): gpu.idle_mb for gpu in gpus.free if gpu.idle_mb is not None},
            "left_out": [{"gpu": gpu.index, "uuid": gpu.uuid, "reason": reason} for gpu, reason in gpus.left_out]}


def probe(request: dict[str, Any]) -> dict[str, Any]:
    gpus = gpu_inventory() if request["use_gpu"] else None  # NVML start-up costs time; CPU runs skip it
    return {**identity(), "tmpdir": tempfile.gettempdir(),
            "free_ports": PortAllocator(EVERY_INTERFACE).allocate(request["ports"]),
            "free_gpus": gpus["pin"] if gpus else [], "gpus": gpus,
            **_workdir_status(request["workdir"])}


def _own_directory(path: Path) -> bool:
    """A real directory (not a symlink) owned by this user."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def release(request: dict[str, Any]) -> dict[str, Any]:
    key = request["run_key"]
    watch = watch_release(set(processes_with_env({RUN_KEY_ENV: key})), idle_mb=request["idle_mb"])
    outcome = end_marked_processes({RUN_KEY_ENV: key}, float(request["grace_s"]))
    removed = []
    if request["workdir"] and not outcome["survivors"]:  # a survivor may still be writing there
        run_dir = host_path(request["workdir"]) / key
        if _own_directory(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            removed.append(str(run_dir))
    gpus = release_check(watch)
    return {"host": socket.gethostname(), "run_key": key, **outcome, "gpu_check": gpus, "removed_dirs": removed,
            "clean": not outcome["survivors"] and release_is_clean(gpus)}


def kill_group(request: dict[str, Any]) -> dict[str, Any]:
    pgid, key = request["pgid"], request["run_key"]
    answer: dict[str, Any] = {"host": socket.gethostname(), "pgid": pgid}
    if pgid <= 1:
        return {**answer, "status": "refused", "reason": f"process group {pgid} is never a worker's"}
    members = live_group_members(pgid)
    if not members:
        return {**answer, "status": "gone", "members": []}
    if not set(members) & set(processes_with_env({RUN_KEY_ENV: key})):
        return {**answer, "status": "refused", "members": members,
                "reason": f"no member of process group {pgid} carries run key {key}"}
    signal_group(pgid, signal.SIGKILL)
    wait_group_gone(pgid, KILL_WAIT_S)
    return {**answer, "status": "killed", "members": members, "survivors": live_group_members(pgid)}


def reap(request: dict[str, Any]) -> dict[str, Any]:
    ended = end_marked_processes({RUN_KEY_ENV: request["run_key"], GROUP_ENV: request["group"]},
                                 float(request["grace_s"]))
    return {"host": socket.gethostname(), **ended}


def slots_free(request: dict[str, Any]) -> dict[str, Any]:
    markers = {RUN_KEY_ENV: request["run_key"], GROUP_ENV: request["group"]}
    check = check_exited_slots(request["pids"], request["gpus"], use_gpu=request["use_gpu"],
                               alive=lambda: sorted(processes_with_env(markers)), idle_mb=request["idle_mb"])
    return {"host": socket.gethostname(), **check}


def utilization(request: dict[str, Any]) -> dict[str, Any]:
    """NVML's utilization of each named GPU (null where it gives none), for the idle-held warning."""
    percent = gpu_utilization(dict(enumerate(request["gpus"])))
    return {"host": socket.gethostname(), "utilization": [percent[index] for index in range(len(request["gpus"]))]}


ANSWERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "probe": probe, "release": release, "kill": kill_group, "reap": reap, "slots": slots_free,
    "utilization": utilization}


def main(args: list[str]) -> int:
    if len(args) != 1 or args[0] not in REQUESTS:
        print(f"usage: python -m {AGENT_MODULE} {{{','.join(REQUESTS)}}} < request.json",
              file=sys.stderr)
        return EXIT_BAD_REQUEST
    mode = args[0]
    out = Output(sys.stdout.buffer)
    try:
        request = read_request(sys.stdin.buffer, mode)
    except BadRequest as error:
        if mode == "run":
            out.control(EXIT_LINE, {"code": EXIT_BAD_REQUEST, "error": str(error)})
        else:
            out.write(json.dumps({"error": str(error)}).encode() + b"\n")
        return EXIT_BAD_REQUEST
    if mode == "run":
        return run_worker(request, out, sys.stdin.buffer)
    out.write(json.dumps(ANSWERS[mode](request)).encode() + b"\n")
    return 0


if __name__ == "__main__":
    # os._exit: daemon threads may still block on stdin, and a normal interpreter shutdown can abort on their lock
    # ("could not acquire lock for <stdin> at interpreter shutdown"); everything worth writing is flushed.
    os._exit(main(sys.argv[1:]))
