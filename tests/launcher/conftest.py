"""Helpers for the launcher tests (and the operator tests that launch the same tiny workers): the entry points,
the process table, a launcher of its own to kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from core.config.access import DATA_ROOTS_ENV, S3_BUCKETS_ENV, STORAGE_ROOT_ENV
from launcher import WorkerGroup
from launcher.process import live_group_members

ENTRYPOINTS = Path(__file__).resolve().parent / "entrypoints"
REPO = Path(__file__).resolve().parents[2]
# The access policy's variables: the prepare task checked the config against them; no worker reads them.
ACCESS_POLICY_ENV = {DATA_ROOTS_ENV: "/srv/corpora", S3_BUCKETS_ENV: "corpora", STORAGE_ROOT_ENV: "s3://corpora/runs"}


def entrypoint_env(**extra: str) -> dict[str, str]:
    """Worker environment that makes the tiny entry points importable (workers run in a temp cwd)."""
    return {"PYTHONPATH": os.pathsep.join([str(ENTRYPOINTS), str(REPO)]), **extra}


def alive(pid: int) -> bool:
    """Whether `pid` is a live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_until_gone(pgids: list[int], timeout_s: float) -> list[int]:
    """Process groups that still have live (non-zombie) members after `timeout_s`; [] when all are gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pgid for pgid in pgids if live_group_members(pgid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def start_launcher(tmp_path: Path, spec: dict, backend: str = "local", settings: dict | None = None,
                   timeout_s: float = 60) -> tuple[subprocess.Popen, list[dict]]:
    """A worker group launched by a process of its own (entrypoints/group_launcher.py), for a test to kill; returns
    the launcher and its workers' records once every rank has started."""
    case = tmp_path / "launcher-case.json"
    case.write_text(json.dumps({"spec": spec, "backend": backend, "settings": settings or {},
                                "workdir": str(tmp_path / "launcher-work")}))
    launcher = subprocess.Popen([sys.executable, str(ENTRYPOINTS / "group_launcher.py"), str(case)],
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO), str(REPO / "plugins")))})
    deadline = time.monotonic() + timeout_s
    for line in launcher.stdout:
        if line.startswith("LAUNCHED "):
            return launcher, json.loads(line.removeprefix("LAUNCHED "))["workers"]
        if time.monotonic() > deadline:
            break
    launcher.kill()
    raise AssertionError(f"the launcher did not start its group (exit {launcher.wait()})")


def guards_of(launcher_pid: int) -> list[int]:
    """Pids of the guard processes a launcher started (launcher.guard)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if b"launcher.guard" in cmdline and ppid == launcher_pid:
            found.append(int(entry.name))
    return found


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> float:
    """Seconds until `predicate()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(interval_s)
    return time.monotonic() - started


def run_past_sigkill(spec, backend, workdir: Path):
    """Run a tiny_worker group whose rank SIGKILLs itself (TINY_WORKER_FAULT="<rank>:sigkill"); returns the result
    and the seconds from that rank's last line ("killing myself with SIGKILL") to the group's end."""
    killed: list[float] = []

    def on_line(rank: int, line: str) -> None:
        if line == "killing myself with SIGKILL":
            killed.append(time.monotonic())

    result = WorkerGroup(spec, backend, workdir, on_line=on_line).run()
    assert killed, "no rank announced its SIGKILL"
    return result, time.monotonic() - killed[0]
