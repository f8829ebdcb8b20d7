"""The release task: end everything this run started, prove it is gone and its GPUs are free, write release.json.

Runs as a teardown whatever happened upstream (success, failure, a killed task), and is idempotent. It trusts two
sources: the run-state records the operator wrote (`runs/<key>/state/*.json`), and the process table itself,
where every worker carries `TFMW_RUN_KEY=<run key>` in its environment, so even a process whose record was never
written (operator killed between launch and record) or a grandchild of a worker is found. The outcome goes to
`release.json` and, when the run has a report, into the report ("released: yes/no" beside the gates).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tasks import report as reports
from tasks.connections import uses_run_storage
from trainer.config import ConfigError, RunConfig
from trainer.layout import StorageLayout, run_key
from trainer.runtime import LAUNCHER_WORKDIR_PREFIX, RUN_KEY_ENV
from trainer.storage import exists, join, list_dir, normalize_root, read_json, write_json_atomic

log = logging.getLogger("gpt_finetune.release")

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ReleaseReport:
    run_key: str
    host: str = field(default_factory=socket.gethostname)
    records: list[str] = field(default_factory=list)
    found: list[dict[str, Any]] = field(default_factory=list)
    terminated: list[int] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    removed_dirs: list[str] = field(default_factory=list)
    gpu_check: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_key": self.run_key,
            "host": self.host,
            "released_at": datetime.now(UTC).isoformat(),
            "state_records": self.records,
            "processes_found": self.found,
            "terminated": self.terminated,
            "killed": self.killed,
            "survivors": self.survivors,
            "removed_dirs": self.removed_dirs,
            "gpu_check": self.gpu_check,
            "clean": not self.survivors and not self.gpu_check.get("held_by_run"),
        }


class ReleaseError(RuntimeError):
    """Something of this run is still alive or still holds a GPU after release."""


def _storage_root(params: Mapping[str, Any]) -> str:
    """The run's storage root even when its settings were invalid (release must still run)."""
    try:
        return normalize_root(RunConfig.from_params(dict(params)).storage_root, relative_to=REPO_ROOT)
    except ConfigError:
        root = params.get("storage_root")
        return normalize_root(root if isinstance(root, str) and root else RunConfig().storage_root, REPO_ROOT)


def processes_of_run(key: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment carries this run's key."""
    marker = f"{RUN_KEY_ENV}={key}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            status = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if status == "Z":  # a zombie holds nothing; its parent reaps it
                continue
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _signal_all(pids: list[int], sig: signal.Signals) -> list[int]:
    signalled = []
    for pid in pids:
        try:
            os.kill(pid, sig)
            signalled.append(pid)
        except ProcessLookupError:
            pass
    return signalled


def _wait_gone(key: str, timeout_s: float) -> dict[int, str]:
    deadline = time.monotonic() + timeout_s
    alive = processes_of_run(key)
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = processes_of_run(key)
    return alive


def gpu_check(run_pids: set[int]) -> dict[str, Any]:
    """Which GPU processes remain, and whether any belongs to this run (NVML); on CPU there is nothing to check."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver or no library: a CPU machine
        return {"nvml": False, "note": f"no NVML ({type(exc).__name__}): no GPU to verify on this host"}
    try:
        devices = []
        held = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            procs = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            held += [{"gpu": index, "pid": pid} for pid in procs if pid in run_pids]
            devices.append({"gpu": index, "used_mb": memory.used // 2**20, "pids": procs})
        return {"nvml": True, "devices": devices, "held_by_run": held}
    finally:
        pynvml.nvmlShutdown()


def _recorded_workers(state_url: str, report: ReleaseReport) -> tuple[set[int], list[str]]:
    """Pids and work directories named by the run-state records; a malformed record is logged and skipped."""
    pids: set[int] = set()
    workdirs: list[str] = []
    for name in list_dir(state_url):
        if not name.endswith(".json"):
            continue
        report.records.append(name)
        try:
            record = read_json(f"{state_url}/{name}")
            pids.update(int(worker["pid"]) for worker in record.get("workers", []))
            if isinstance(record.get("workdir"), str):
                workdirs.append(record["workdir"])
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("State record %s/%s is malformed (%s): skipped; the process scan still covers it.",
                        state_url, name, error)
    return pids, workdirs


def is_launcher_workdir(path: str) -> bool:
    """Only the launcher's own temporary directories may be deleted: a path read from storage proves nothing."""
    candidate = Path(path)
    try:
        owned = candidate.lstat().st_uid == os.getuid() and not candidate.is_symlink() and candidate.is_dir()
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    return (owned and candidate.name.startswith(LAUNCHER_WORKDIR_PREFIX)
            and candidate.resolve().parent == Path(tempfile.gettempdir()).resolve())


def _describe(pids: list[int], cmdlines: dict[int, str]) -> str:
    return ", ".join(f"pid {pid} ({cmdlines.get(pid, '?')[:80]})" for pid in pids) or "none"


@uses_run_storage
def release_run(params: Mapping[str, Any], run_id: str, dag_id: str,
                grace_period_s: float = 10.0) -> dict[str, Any]:
    key = run_key(dag_id, run_id)
    report = ReleaseReport(key)

    # The process table first: ending the run's processes must not depend on storage being reachable.
    alive = processes_of_run(key)  # recorded pids still alive carry the marker too; pids alone may be reused
    report.found = [{"pid": pid, "cmdline": cmd[:200]} for pid, cmd in sorted(alive.items())]
    log.info("Release of run %s on %s: %d live process(es)", key, report.host, len(alive))
    if alive:
        report.terminated = _signal_all(sorted(alive), signal.SIGTERM)
        remaining = _wait_gone(key, grace_period_s)
        report.killed = _signal_all(sorted(remaining), signal.SIGKILL)
        report.survivors = sorted(_wait_gone(key, 5.0))

    run = StorageLayout(_storage_root(params)).run(key)
    try:
        recorded_pids, workdirs = _recorded_workers(run.state, report)
        for workdir in workdirs:
            if is_launcher_workdir(workdir):
                shutil.rmtree(workdir, ignore_errors=True)
                report.removed_dirs.append(workdir)
            elif os.path.exists(workdir):
                log.warning("Not removing %s: not a launcher work directory of this user under %s.", workdir,
                            tempfile.gettempdir())
        report.gpu_check = gpu_check(recorded_pids | set(alive))
        result = report.to_dict()
        write_json_atomic(run.release, result)
        mark_report_released(run.report, result)
    except Exception as error:
        raise ReleaseError(
            f"Release of run {key} on {report.host} could not be recorded: {type(error).__name__}: {error}. "
            f"Processes ended: {len(report.terminated)} terminated, {len(report.killed)} killed; still alive: "
            f"{_describe(report.survivors, alive)}. Fix access to the storage root (storage_root / "
            f"storage_conn_id) and clear the release task; until it succeeds this run counts as not released."
        ) from error
    log.info(
        "Release of run %s on %s: terminated %s, killed %s, survivors %s; GPUs: %s; written %s",
        key, report.host, report.terminated, report.killed, report.survivors,
        report.gpu_check.get("note") or report.gpu_check.get("devices"), run.release,
    )
    if not result["clean"]:
        raise ReleaseError(
            f"Run {key} is not fully released on {report.host}: still alive: "
            f"{_describe(report.survivors, alive)}; GPU holders: {report.gpu_check.get('held_by_run') or 'none'}. "
            f"End them by hand (kill -9 <pid>) and clear the release task."
        )
    return {"release_url": run.release, **{k: result[k] for k in ("clean", "terminated", "killed")}}


def mark_report_released(report_url: str, release: dict[str, Any]) -> None:
    """Put the release outcome into the run's report (report.json and report.md), when evaluate wrote one."""
    json_url = join(report_url, reports.REPORT_JSON)
    if not exists(json_url):
        return
    report = read_json(json_url)
    report["release"] = {name: release[name] for name in ("clean", "released_at", "host", "survivors")}
    reports.write_report(report_url, report, charts={})
