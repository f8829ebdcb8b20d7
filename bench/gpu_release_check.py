"""GPU release check: the local backend's placement and release against real GPUs, without TensorFlow.

    python3 -m bench.gpu_release_check [--hold-mib 4096]    # a GPU host: NVIDIA driver, Python, nvidia-ml-py
    python3 -m bench.gpu_release_check --dry-run            # the same flow on the fake NVML (a test runs it)

Needs the standard library, nvidia-ml-py, the driver's libcuda and the two libraries the launcher keeps, psutil and
pydantic (with pydantic_core, typing_extensions, annotated_types and typing_inspection): no TensorFlow, no Airflow.
A host without them takes them on PYTHONPATH (for its Python: `pip download --only-binary=:all: --python-version
3.12 --no-deps psutil pydantic pydantic_core typing_extensions annotated_types typing_inspection`, unzipped into
one folder). Its stand-in worker holds GPU memory through ctypes on
libcuda (cuInit, cuDeviceGet, cuCtxCreate_v2, cuMemAlloc_v2).

First it prints each GPU's idle figures (`idle_levels`) read by both of NVML's memory calls, v1
(`nvmlDeviceGetMemoryInfo(handle)`: `used` holds the driver's reservation) and v2 (`version=nvmlMemory_v2`:
`reserved` apart), or what the driver answered instead: the idle level placement records and release waits for
(launcher/gpu_memory.py) was measured by v1 only (615 MiB on an H200, driver 580.159.04). Then three checks (issues
38 and 47; the evidence is in ../shared/research/gpu_paths_review.md, sections 3-5):
1. busy_gpu_not_admitted: a stand-in holds the first GPU; placing one worker per GPU of the host is refused, naming
   that GPU.
2. stubborn_worker_released: a stand-in that carries the run key and ignores SIGTERM holds the first GPU;
   LocalBackend.release ends it (TERM, grace, KILL), waits for NVML to drop it and for the GPU's memory to come back
   to the idle level recorded for it, and must report clean; the figures are the release's wall time and
   `free_after_s`, how long NVML took to free the GPU after the process was ended.
3. other_namespace_not_free: a stand-in holds the first GPU from this PID namespace while the placement probe runs in
   a new one (`unshare --pid --fork --mount-proc`): drivers >= 570 list no process there, but the GPU's memory is in
   use, so it must not be free. Skipped, with the reason, where unshare is refused. The dry run models it with a
   process the fake NVML does not list.
Prints one JSON object; exits 0 when every check that ran passed, 1 when one failed, 2 when there is no GPU to check.
Takes well under two minutes. bench/gpu_check.py stays the check for hosts with TensorFlow.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
READY_LINE = "held"
HOLD_START_TIMEOUT_S = 60.0
UNSHARE_VARIANTS = (("unshare", "--pid", "--fork", "--mount-proc"),
                    ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold-mib", type=int, default=4096, help="GPU memory each stand-in worker holds")
    parser.add_argument("--grace", type=float, default=1.0, help="release's grace between SIGTERM and SIGKILL")
    parser.add_argument("--dry-run", action="store_true", help="the fake NVML and stand-ins that hold nothing")
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)  # internal: be a stand-in worker
    parser.add_argument("--ignore-term", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # internal: placement's probe
    args = parser.parse_args(argv)
    if args.hold:
        return _stand_in(args.hold_mib, args.ignore_term, args.dry_run)
    if args.probe:
        print(json.dumps(_probe_record()))
        return 0
    report = _run(args)
    print(json.dumps(report, indent=2))
    if "error" in report:
        return 2
    return 0 if report["ok"] else 1


# -- the stand-in worker ---------------------------------------------------------------------------------------------

def _stand_in(hold_mib: int, ignore_term: bool, dry_run: bool) -> NoReturn:
    """Hold `hold_mib` MiB on the first visible GPU (CUDA_VISIBLE_DEVICES: the GPU's UUID), say so, then wait for
    the signal that ends it (SIGTERM ignored with `ignore_term`: only SIGKILL does)."""
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    memory = None if dry_run else _hold_gpu_memory(hold_mib)
    print(READY_LINE, flush=True)
    while memory is not None or dry_run:
        signal.pause()
    raise AssertionError("unreachable")


def _hold_gpu_memory(hold_mib: int) -> tuple[ctypes.c_void_p, ctypes.c_uint64]:
    cuda = ctypes.CDLL("libcuda.so.1")
    device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for call, arguments in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(device), 0)),
                            ("cuCtxCreate_v2", (ctypes.byref(context), 0, device)),
                            ("cuMemAlloc_v2", (ctypes.byref(pointer), ctypes.c_size_t(hold_mib << 20)))):
        result = getattr(cuda, call)(*arguments)
        if result != 0:
            raise SystemExit(f"stand-in worker: {call} failed with CUresult {result} (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return context, pointer


class StandIns:
    """The stand-in workers of one check run: started on a GPU, each ended and reaped at the end."""

    def __init__(self, args: argparse.Namespace, fake: Any) -> None:
        self.args, self.fake = args, fake
        self.processes: list[subprocess.Popen] = []

    def start(self, gpu: Any, *, run_key: str | None = None, ignore_term: bool = False) -> subprocess.Popen:
        from core.protocol import RUN_KEY_ENV

        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid or str(gpu.index),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if run_key:
            env[RUN_KEY_ENV] = run_key
        command = [sys.executable, "-m", "bench.gpu_release_check", "--hold", "--hold-mib", str(self.args.hold_mib),
                   *(["--ignore-term"] if ignore_term else []), *(["--dry-run"] if self.fake else [])]
        process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.processes.append(process)
        ready, _, _ = select.select([process.stdout], [], [], HOLD_START_TIMEOUT_S)
        if not ready or process.stdout.readline().strip() != READY_LINE:
            raise RuntimeError(f"stand-in worker on {gpu.label} did not hold its memory within "
                               f"{HOLD_START_TIMEOUT_S:g} s (exit code {process.poll()})")
        if self.fake:
            self.fake.attach(process.pid, gpu.index, self.args.hold_mib << 20)
        return process

    def end_all(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()


# -- the checks ------------------------------------------------------------------------------------------------------

def _run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    fake = _install_fake_nvml() if args.dry_run else None
    from launcher.gpus import probe_gpus

    inventory = probe_gpus()
    gpus = sorted([*inventory.free, *(gpu for gpu, _ in inventory.left_out)], key=lambda gpu: gpu.index)
    if inventory.unavailable or not gpus:
        return {"dry_run": args.dry_run, "host": socket.gethostname(), "ok": False,
                "error": f"no GPU to check on {socket.gethostname()} (NVML: {inventory.unavailable or 'no GPU'}): "
                         "run it on a GPU host with the NVIDIA driver and nvidia-ml-py, or pass --dry-run"}
    if gpus[0] not in inventory.free:
        return {"dry_run": args.dry_run, "host": socket.gethostname(), "ok": False,
                "error": f"{gpus[0].label} is not free before the check ({inventory.describe_left_out()})"}
    idle_levels = _idle_levels()  # before any stand-in runs: what each GPU reads with nothing of ours on it
    stand_ins = StandIns(args, fake)
    checks: dict[str, dict[str, Any]] = {}
    try:
        for name, check in (("busy_gpu_not_admitted", _busy_gpu_not_admitted),
                            ("stubborn_worker_released", _stubborn_worker_released),
                            ("other_namespace_not_free", _other_namespace_not_free)):
            checks[name] = check(args, gpus, stand_ins, fake)
            _wait_until_free(gpus[0], stand_ins)
    finally:
        stand_ins.end_all()
    return {"dry_run": args.dry_run, "host": socket.gethostname(), "driver": _driver(),
            "gpus": [gpu.record() for gpu in gpus], "idle_levels": idle_levels, "hold_mib": args.hold_mib,
            "checks": checks,
            "ok": all(check["ok"] is not False for check in checks.values()),
            "wall_s": round(time.monotonic() - started, 2)}


def _busy_gpu_not_admitted(args, gpus, stand_ins: StandIns, fake) -> dict[str, Any]:
    from launcher import GroupSpec, InsufficientGPUsError, LocalBackend
    from launcher.gpus import probe_gpus

    stand_ins.start(gpus[0])
    free = probe_gpus().free_indices
    group = GroupSpec(name="gpu-release-check", entrypoint="bench.gpu_release_check", num_workers=len(gpus),
                      use_gpu=True)
    try:
        placed = [p.devices for p in LocalBackend().place(group)]
        refusal = None
    except InsufficientGPUsError as error:
        placed, refusal = [], str(error)
    named = refusal is not None and f"{gpus[0].label}: compute process(es)" in refusal
    return {"ok": gpus[0].index not in free and not placed and named, "gpu": gpus[0].index, "free": free,
            "placed": placed, "refusal": refusal}


def _stubborn_worker_released(args, gpus, stand_ins: StandIns, fake) -> dict[str, Any]:
    from core.clock import utc_now
    from launcher import LocalBackend
    from launcher.state_record import RecordedWorker, StateRecord

    key = f"gpu-release-check-{uuid.uuid4().hex[:12]}"
    worker = stand_ins.start(gpus[0], run_key=key, ignore_term=True)
    name = str(gpus[0].uuid or gpus[0].index)
    idle = {name: gpus[0].idle_mb} if gpus[0].idle_mb is not None else None  # as placement records it
    placed = RecordedWorker(0, "localhost", None, (name,), idle, extra={"pid": worker.pid})
    records = [StateRecord("train", "local", "running", utc_now(), "", workers=(placed,))]
    started = time.monotonic()
    released = LocalBackend().release(key, records, grace_s=args.grace)
    release_s = time.monotonic() - started
    host = released.hosts[0].entry()
    gpu_check = host["gpu_check"]
    return {"ok": released.clean and host["killed"] == [worker.pid], "clean": released.clean,
            "terminated": host["terminated"], "killed": host["killed"], "survivors": host["survivors"],
            "release_s": round(release_s, 3), "grace_s": args.grace, "idle_mb_recorded": idle,
            "free_after_s": gpu_check.get("free_after_s"),
            "held_by_run": gpu_check.get("held_by_run"), "unverified": gpu_check.get("unverified")}


def _other_namespace_not_free(args, gpus, stand_ins: StandIns, fake) -> dict[str, Any]:
    if fake is not None:  # drivers >= 570 drop another namespace's process from the list; its memory stays in use
        holder = fake.start_process(gpus[0].index, args.hold_mib << 20, listed_pid=None)
        inside, how = _probe_record(), "modelled: the fake NVML lists no process, its memory is in use"
        fake.end_process(holder.pid)
    else:
        stand_ins.start(gpus[0])
        inside, how = _probe_in_new_namespace()
        if inside is None or inside["unavailable"]:
            return {"ok": None, "skipped": how if inside is None else f"NVML inside `{how}`: {inside['unavailable']}"}
    seen = next((gpu for gpu in inside["gpus"] if gpu["gpu"] == gpus[0].index), {})
    return {"ok": gpus[0].index not in inside["free"], "namespace": how, "gpu": gpus[0].index,
            "free_inside": inside["free"], "listed_inside": seen.get("pids"), "used_mb_inside": seen.get("used_mb"),
            "reason_inside": seen.get("reason")}


def _probe_in_new_namespace() -> tuple[dict[str, Any] | None, str]:
    """The placement probe run in a new PID namespace: its JSON and the command, or None and why not."""
    if shutil.which("unshare") is None:
        return None, "unshare is not installed (util-linux)"
    refusals = []
    for variant in UNSHARE_VARIANTS:
        done = subprocess.run([*variant, sys.executable, "-m", "bench.gpu_release_check", "--probe"], cwd=REPO,
                              capture_output=True, text=True, timeout=60, check=False)
        if done.returncode == 0:
            return json.loads(done.stdout), " ".join(variant)
        refusals.append(f"`{' '.join(variant)}`: {(done.stderr.strip().splitlines() or ['exit'])[-1]}")
    return None, "unshare refused: " + "; ".join(refusals)


def _probe_record() -> dict[str, Any]:
    from launcher.gpus import probe_gpus

    inventory = probe_gpus()
    return {"free": inventory.free_indices, "unavailable": inventory.unavailable,
            "gpus": [{**gpu.record(), "reason": reason} for gpu, reason in inventory.left_out]}


def _wait_until_free(gpu: Any, stand_ins: StandIns, timeout_s: float = 30.0) -> None:
    """End this check's stand-ins and wait until NVML shows the GPU free again, so checks do not see each other."""
    from launcher.gpus import probe_gpus

    stand_ins.end_all()
    deadline = time.monotonic() + timeout_s
    while gpu.index not in probe_gpus().free_indices and time.monotonic() < deadline:
        time.sleep(0.05)


def _idle_levels() -> list[dict[str, Any]]:
    """Each GPU's memory by v1 and by v2 (MiB), with the pids NVML lists on it; a call's refusal in its place."""
    from launcher.host_probe import nvml

    def read(pynvml: Any, handle: Any, **version: int) -> dict[str, Any]:
        try:
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle, **version)
        except pynvml.NVMLError as error:
            return {"refused": f"{type(error).__name__}: {error}"}
        fields = ("total", "reserved", "free", "used") if version else ("total", "free", "used")
        return {field: getattr(memory, field) >> 20 for field in fields}

    levels = []
    with nvml() as pynvml:
        for index in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except pynvml.NVMLError as error:
                levels.append({"gpu": index, "error": f"{type(error).__name__}: {error}"})
                continue
            v2 = getattr(pynvml, "nvmlMemory_v2", None)
            levels.append({"gpu": index, "pids": pids, "v1_mib": read(pynvml, handle),
                           "v2_mib": read(pynvml, handle, version=v2) if v2 else {"refused": "no nvmlMemory_v2"}})
    return levels


def _driver() -> str | None:
    from launcher.host_probe import NvmlUnavailable, nvml

    try:
        with nvml() as pynvml:
            return pynvml.nvmlSystemGetDriverVersion()
    except NvmlUnavailable:
        return None


def _install_fake_nvml() -> Any:
    """The dry run's NVML: two idle H200s whose process lists lag a kill by the measured 0.1 s."""
    from tests.support.fake_nvml import FakeNvml, h200s

    fake = FakeNvml(h200s(2))
    sys.modules["pynvml"] = fake
    return fake


if __name__ == "__main__":
    raise SystemExit(main())
