"""The release task: end everything this run started, prove it is gone and its GPUs are free, write release.json.

Runs as a teardown whatever happened upstream (success, failure, a killed task), and is idempotent. It trusts two
sources: the run-state records the operator wrote (`runs/<key>/state/*.json`), and the process table itself,
where every worker carries `TFMW_RUN_KEY=<run key>` in its environment, so even a process whose record was never
written (operator killed between launch and record) or a grandchild of a worker is found.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, RunConfig
from trainer.layout import StorageLayout, run_key
from trainer.runtime import RUN_KEY_ENV
from trainer.storage import list_dir, normalize_root, read_json, write_json_atomic

log = logging.getLogger("gpt_finetune.release")

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class ReleaseReport:
    run_key: str
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


def release_run(params: Mapping[str, Any], run_id: str, grace_period_s: float = 10.0) -> dict[str, Any]:
    key = run_key(run_id)
    run = StorageLayout(_storage_root(params)).run(key)
    report = ReleaseReport(key)

    recorded_pids: set[int] = set()
    workdirs: list[str] = []
    for name in list_dir(run.state):
        if not name.endswith(".json"):
            continue
        record = read_json(f"{run.state}/{name}")
        report.records.append(name)
        recorded_pids.update(int(worker["pid"]) for worker in record.get("workers", []))
        if record.get("workdir"):
            workdirs.append(record["workdir"])

    alive = processes_of_run(key)  # recorded pids still alive carry the marker too; pids alone may be reused
    report.found = [{"pid": pid, "cmdline": cmd[:200]} for pid, cmd in sorted(alive.items())]
    log.info("Release of run %s: %d state record(s), %d live process(es)", key, len(report.records), len(alive))

    if alive:
        report.terminated = _signal_all(sorted(alive), signal.SIGTERM)
        remaining = _wait_gone(key, grace_period_s)
        report.killed = _signal_all(sorted(remaining), signal.SIGKILL)
        report.survivors = sorted(_wait_gone(key, 5.0))

    for workdir in workdirs:
        if os.path.isdir(workdir):
            shutil.rmtree(workdir, ignore_errors=True)
            report.removed_dirs.append(workdir)

    report.gpu_check = gpu_check(recorded_pids | set(alive))
    result = report.to_dict()
    write_json_atomic(run.release, result)
    log.info(
        "Release of run %s: terminated %s, killed %s, survivors %s; GPUs: %s; written %s",
        key, report.terminated, report.killed, report.survivors,
        report.gpu_check.get("note") or report.gpu_check.get("devices"), run.release,
    )
    if not result["clean"]:
        raise ReleaseError(
            f"Run {key} is not fully released: survivors {report.survivors}, GPU holders "
            f"{report.gpu_check.get('held_by_run')}. End them by hand (kill -9) and rerun the release task."
        )
    return {"release_url": run.release, **{k: result[k] for k in ("clean", "terminated", "killed")}}
