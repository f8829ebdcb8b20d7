"""Preflight: every worker checks itself, then the group runs collectives with known answers and measures them.

    python -m trainer.selftest --config URL --manifest URL --output REPORT_DIR_URL

Per worker (no TensorFlow collectives yet): host, rank, Python/TF/tf-keras/transformers versions, visible GPUs
(NVML) with memory, free disk for shard staging, reading the manifest and this rank's shards, writing to
`storage_root`. The result goes to `<output>/preflight/rank-<r>.json`: a side channel that still works when the
collectives do not, so the chief can say which ranks answered.

Then, with `MultiWorkerMirroredStrategy` built as training builds it: an all-reduce whose exact answer names every
rank (rank r contributes r + 1 at index r, so the sum must be [1, 2, ..., N]), a broadcast (MWMS copies the chief's
initial variable values to every worker, as it does for model weights), a bandwidth probe (algorithm bandwidth =
bytes / time of one all-reduce, bus bandwidth = algbw * 2(N-1)/N) and small-message latency. The whole collective
phase is bounded by `collective_timeout_s`; past it the worker reports and exits instead of waiting forever.

Once its TensorFlow server is up, each worker also tries its own port on every non-loopback address of its host:
TF's worker channel listens on all interfaces without authentication, so an answer there means anyone who can
route to that address may run code as this user (docs/security.md). This is reported, not an error.

The chief compares versions and the fingerprint of this project's own code across ranks (skew is an error), runs
the scaling advisor (`trainer/advisor.py`: a few single-worker steps, or the reused baseline's step time, against
the measured bandwidth and latency; below `min_predicted_efficiency` is an error), writes `<output>/preflight.json`
and a one-screen summary to the log. Any error exits non-zero, so training never launches.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import ipaddress
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from tf_multiworker.launcher.log_policy import configure_worker_logging

from trainer import runtime, storage
from trainer.config import RunConfig
from trainer.layout import PreflightOutput
from trainer.metrics import print_live_line

log = logging.getLogger("trainer.selftest")

# Tests only: "<rank>:<version>" makes that rank report another TensorFlow version (a simulated skew).
FAKE_TF_VERSION_ENV = "GPT_FINETUNE_SELFTEST_FAKE_TF_VERSION"
VERSIONED_PACKAGES = ("tensorflow", "tf-keras", "transformers", "numpy")
# This project's code that runs on the workers' hosts. Ranks with different copies may shard the data differently
# or wait in a collective only some of them run, and no package version shows it.
CODE_PACKAGES = ("trainer", "tf_multiworker")
BANDWIDTH_BYTES = 8 << 20
BANDWIDTH_ITERATIONS = 5
LATENCY_ITERATIONS = 20
# Room for a checkpoint and the model next to the staged shards.
EXIT_CHECKS_FAILED = 1
EXIT_COLLECTIVES_FAILED = 3
# A failing non-chief waits this long for the chief's report before exiting: the launcher stops the whole group
# as soon as one rank exits non-zero, and the chief's preflight.json is what names every rank's problem.
CHIEF_REPORT_WAIT_S = 15.0


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# -- per-worker checks ------------------------------------------------------------------------------------------

def package_versions(rank: int) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "missing"
    fake = os.environ.get(FAKE_TF_VERSION_ENV, "")
    if fake and int(fake.split(":", 1)[0]) == rank:
        versions["tensorflow"] = fake.split(":", 1)[1]
    return versions


def visible_gpus() -> dict[str, Any]:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES, as the launcher pinned it) with NVML name and memory."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import pynvml
    except ImportError:
        return {"nvml": "unavailable (nvidia-ml-py not installed)", "cuda_visible_devices": visible, "gpus": []}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:  # no driver: a CPU machine
        return {"nvml": f"unavailable ({error})", "cuda_visible_devices": visible, "gpus": []}
    try:
        indices = range(pynvml.nvmlDeviceGetCount())
        if visible is not None:
            indices = [int(i) for i in visible.split(",") if i.strip().isdigit()]
        gpus = []
        for index in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append({"index": index, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_total_mb": memory.total >> 20, "memory_free_mb": memory.free >> 20})
        return {"nvml": pynvml.nvmlSystemGetDriverVersion(), "cuda_visible_devices": visible, "gpus": gpus}
    finally:
        pynvml.nvmlShutdown()


def code_fingerprint(locations: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """sha256 of this host's copy of CODE_PACKAGES (package -> its directories, found without importing them: the
    operator module imports Airflow): one digest for the whole, and a short one per file to name what differs."""
    if locations is None:
        specs = {package: importlib.util.find_spec(package) for package in CODE_PACKAGES}
        locations = {package: list(spec.submodule_search_locations or []) for package, spec in specs.items() if spec}
    files = {}
    for package, roots in sorted(locations.items()):
        for root in roots:
            for path in sorted(Path(root).rglob("*.py")):
                name = f"{package}/{path.relative_to(root).as_posix()}"
                files[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"fingerprint": hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16],
            "files": files}


def check_worker(cfg: RunConfig, manifest_url: str, identity: runtime.WorkerIdentity) -> dict[str, Any]:
    """Everything one worker can check alone. Problems go to `errors`, each naming the setting to change."""
    from trainer import shard_cache
    from trainer.data import DataError, load_manifest, shard_cache_root, worker_shards

    errors: list[str] = []
    # The address its peers reach it at (TF_CONFIG) tells hosts apart where hostnames repeat (containers, VMs).
    address = identity.addresses[identity.rank] if identity.addresses else None
    where = f"rank {identity.rank} on {identity.host}" + (f" ({address})" if address else "")
    report: dict[str, Any] = {"rank": identity.rank, "host": identity.host, "address": address, "pid": os.getpid(),
                              "versions": package_versions(identity.rank), "code": code_fingerprint(),
                              "devices": visible_gpus()}
    if identity.num_workers != cfg.num_workers:
        errors.append(f"{where}: TF_CONFIG lists {identity.num_workers} workers but num_workers={cfg.num_workers}: "
                      "the launcher and the run configuration disagree")
    if cfg.use_gpu and not report["devices"]["gpus"]:
        errors.append(f"{where}: use_gpu is true but no GPU is visible (NVML: {report['devices']['nvml']}, "
                      f"CUDA_VISIBLE_DEVICES={report['devices']['cuda_visible_devices']!r}): set use_gpu to false or "
                      "run on a machine with free GPUs")

    shard_bytes = 0
    try:
        manifest = load_manifest(manifest_url)
        shards = worker_shards(manifest, "train", identity.rank, identity.num_workers)
        shard_bytes = sum(shard["bytes"] for shard in shards)
        base = manifest_url.rstrip("/").rsplit("/", 1)[0]
        absent = [s["name"] for s in shards if not storage.exists(storage.join(base, s["name"]))]
        if absent:
            errors.append(f"{where}: shard(s) {absent} listed in {manifest_url} do not exist: prepare the dataset again")
        report["manifest"] = {"ok": not absent, "fingerprint": manifest["fingerprint"], "shards": len(shards),
                              "shard_bytes": shard_bytes}
    except (DataError, OSError, ValueError, KeyError) as error:
        errors.append(f"{where}: cannot read the manifest {manifest_url}: {error}")
        report["manifest"] = {"ok": False, "error": str(error)}

    cache = shard_cache_root()
    staging = runtime.host_temp_dir()  # where the shard cache lies
    fingerprint = report["manifest"].get("fingerprint", "")
    missing = shard_cache.missing_bytes(cache / fingerprint, shards) if fingerprint else shard_bytes
    free = shutil.disk_usage(staging).free
    needed = shard_cache.room_for(missing)
    report["disk"] = {"path": staging, "free_bytes": free, "needed_bytes": needed}
    if free < needed:  # training would first evict the datasets no worker holds
        report["disk"]["reclaimable_bytes"] = reclaimable = shard_cache.reclaimable_bytes(cache, keep=fingerprint)
        if free + reclaimable < needed:
            errors.append(f"{where}: {staging} has {free >> 20} MiB free and {reclaimable >> 20} MiB of idle cached "
                          f"datasets, shard staging needs about {needed >> 20} MiB: free disk space or point TMPDIR "
                          "at a larger disk")

    probe = storage.join(cfg.storage_root, ".preflight", f"{identity.host}-rank{identity.rank}-{uuid.uuid4().hex}")
    try:
        storage.write_bytes_atomic(probe, b"preflight")
        storage.remove_tree(probe)
        report["storage"] = {"ok": True, "root": cfg.storage_root}
    except Exception as error:  # noqa: BLE001 - any backend error means the same: training could not save
        errors.append(f"{where}: cannot write to storage_root {cfg.storage_root}: {type(error).__name__}: {error}. "
                      "Check storage_root and the storage connection's credentials")
        report["storage"] = {"ok": False, "root": cfg.storage_root, "error": str(error)}
    report["errors"] = errors
    return report


# -- collectives ------------------------------------------------------------------------------------------------

def create_strategy(cfg: RunConfig):
    """MWMS as training creates it (same implementation), with the preflight's bounded collective timeout."""
    import tensorflow as tf

    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[cfg.communication]
    options = tf.distribute.experimental.CommunicationOptions(implementation=implementation,
                                                              timeout_seconds=cfg.collective_timeout_s)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    runtime.end_on_sigterm()
    return strategy


def _all_reduce_fn(strategy):
    import tensorflow as tf

    @tf.function
    def reduce(value):
        def replica(v):
            # identity places the input on this replica's device; the bare function input has none
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(v))

        return strategy.run(replica, args=(value,))

    def call(value) -> Any:
        return strategy.experimental_local_results(reduce(value))[0].numpy()

    return call


def run_collectives(strategy, rank: int, num_workers: int) -> dict[str, Any]:
    import numpy as np
    import tensorflow as tf

    all_reduce = _all_reduce_fn(strategy)
    contribution = np.zeros(num_workers, dtype=np.float32)
    contribution[rank] = rank + 1
    got = all_reduce(tf.constant(contribution))
    expected = np.arange(1, num_workers + 1, dtype=np.float32)
    wrong = [r for r in range(num_workers) if got[r] != expected[r]]
    results: dict[str, Any] = {"all_reduce": {"expected": expected.tolist(), "got": got.tolist(), "ok": not wrong,
                                              "wrong_ranks": wrong}}

    with strategy.scope():
        # MWMS broadcasts the chief's initial value to every worker: rank 0's pattern must arrive everywhere.
        variable = tf.Variable(np.arange(4, dtype=np.float32) + 100.0 * (rank + 1))
    seen = variable.numpy()
    chief_value = np.arange(4, dtype=np.float32) + 100.0
    results["broadcast"] = {"expected": chief_value.tolist(), "got": seen.tolist(),
                            "ok": bool(np.array_equal(seen, chief_value))}

    payload = tf.constant(np.ones(BANDWIDTH_BYTES // 4, dtype=np.float32))
    all_reduce(payload)  # warm-up: builds the function and the ring for this size
    times = []
    for _ in range(BANDWIDTH_ITERATIONS):
        started = time.perf_counter()
        total = all_reduce(payload)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    algbw = BANDWIDTH_BYTES / seconds
    results["bandwidth"] = {
        "bytes": BANDWIDTH_BYTES, "iterations": BANDWIDTH_ITERATIONS, "median_s": seconds,
        "algbw_gbps": algbw / 1e9, "busbw_gbps": algbw * 2 * (num_workers - 1) / num_workers / 1e9,
        "ok": bool(total[0] == num_workers),
    }

    tiny = tf.constant(np.ones(1, dtype=np.float32))
    all_reduce(tiny)
    latencies = []
    for _ in range(LATENCY_ITERATIONS):
        started = time.perf_counter()
        all_reduce(tiny)
        latencies.append(time.perf_counter() - started)
    results["latency"] = {"bytes": 4, "iterations": LATENCY_ITERATIONS,
                          "p50_ms": statistics.median(latencies) * 1e3, "max_ms": max(latencies) * 1e3}
    return results


def wait_for_every_rank(output: str, identity: runtime.WorkerIdentity) -> None:
    """Return once every rank of this attempt has written its report with collectives: all are past their last
    collective, and the chief can read every report.

    Not a collective barrier: a rank that leaves right after its last collective closes the sockets a peer may
    still be reading that collective's data from, and the peer fails with `UNAVAILABLE: Socket closed` (RecvBuf).
    Two ranks on loopback, one leaving at once after its last all-reduce: 2 of 25 runs failed so. The caller's
    `collective_timeout_s` bounds the wait."""
    waiting, delay = set(range(identity.num_workers)) - {identity.rank}, 0.05
    while waiting:
        for rank in sorted(waiting):
            try:
                report = storage.read_json(PreflightOutput(output).rank_report(rank))
            except (FileNotFoundError, ValueError):  # not written yet, or being replaced
                continue
            if report.get("group_id") == group_id(identity) and "collectives" in report:
                waiting.discard(rank)
        if waiting:
            time.sleep(delay)
            delay = min(2 * delay, 1.0)  # ranks finish within moments of each other; a slow one costs few reads


# -- the group's verdict (chief) --------------------------------------------------------------------------------

def group_id(identity: runtime.WorkerIdentity) -> str:
    """Same for every rank of one launch attempt (its addresses), different for the next attempt."""
    return hashlib.sha256(json.dumps(identity.addresses).encode()).hexdigest()[:16]


def read_rank_reports(output: str, identity: runtime.WorkerIdentity) -> dict[int, dict[str, Any]]:
    reports = {}
    for rank in range(identity.num_workers):
        try:
            report = storage.read_json(PreflightOutput(output).rank_report(rank))
        except (FileNotFoundError, ValueError):
            continue
        if report.get("group_id") == group_id(identity):
            reports[rank] = report
    return reports


def probe_address(address: str, timeout_s: float = 2.0) -> str:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return "reachable"
    except ConnectionRefusedError:
        return "connection refused (nothing listens on that port: the worker is not running or the port is wrong)"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s (host down, wrong address or a firewall)"
    except OSError as error:
        return f"unreachable ({error})"


def version_skew(reports: dict[int, dict[str, Any]]) -> list[str]:
    errors = []
    for package in ("python", *VERSIONED_PACKAGES):
        by_version: dict[str, list[int]] = {}
        for rank, report in sorted(reports.items()):
            by_version.setdefault(report["versions"].get(package, "missing"), []).append(rank)
        if len(by_version) > 1:
            spread = "; ".join(f"{version} on rank(s) {ranks}" for version, ranks in by_version.items())
            errors.append(f"version skew in {package}: {spread}. Install the same environment on every worker "
                          "(uv sync --frozen from the same uv.lock)")
    by_code: dict[str, list[int]] = {}
    for rank, report in sorted(reports.items()):
        by_code.setdefault(report.get("code", {}).get("fingerprint", "unknown"), []).append(rank)
    if len(by_code) > 1:
        copies = [reports[ranks[0]].get("code", {}).get("files", {}) for ranks in by_code.values()]
        differ = sorted({name for files in copies for name in files if len({c.get(name) for c in copies}) > 1})
        named = ", ".join(differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
        spread = "; ".join(f"{fingerprint} on rank(s) {ranks} ({', '.join(sorted({reports[r]['host'] for r in ranks}))})"
                           for fingerprint, ranks in by_code.items())
        errors.append(f"the project's code differs between workers: {spread}; files that differ: {named or 'unknown'}. "
                      "Deploy the same checkout of this project on every host (in remote_python's environment "
                      "there) or the same trainer image")
    return errors


def collective_failure_message(phase: str, error: str, identity: runtime.WorkerIdentity,
                               reports: dict[int, dict[str, Any]], timeout_s: float) -> tuple[str, dict[int, str]]:
    answered = sorted(reports)
    missing = [r for r in range(identity.num_workers) if r not in reports]
    probes = {r: probe_address(identity.addresses[r]) for r in range(identity.num_workers) if r != identity.rank}
    lines = [f"collectives failed during {phase} (collective_timeout_s={timeout_s:g}): {error}",
             f"ranks that answered: {answered or 'none'}; ranks that did not: {missing or 'none'}"]
    lines += [f"rank {r} at {identity.addresses[r]}: {state}" for r, state in sorted(probes.items())]
    lines.append("Check: the address and port of each worker in TF_CONFIG, firewalls between hosts, that every "
                 "worker started (see the launcher's log for ranks that never came up), matching versions, and "
                 "the GPU count. Raise collective_timeout_s only if workers are slow to start.")
    return "\n".join(lines), probes


def port_exposure(identity: runtime.WorkerIdentity, timeout_s: float = 1.0) -> dict[str, Any]:
    """Whether this worker's TF port accepts connections on the host's non-loopback addresses.

    Connecting from the same host shows that the port listens there; whether other hosts get through depends on
    the firewall or network in between, which is why docs/security.md asks to keep worker networks private."""
    import psutil

    port = int(identity.addresses[identity.rank].rsplit(":", 1)[1])
    checked, reachable = [], []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(address.address.split("%")[0])
            if ip.is_loopback or ip.is_link_local:
                continue
            checked.append(str(ip))
            with socket.socket(address.family, socket.SOCK_STREAM) as probe:
                probe.settimeout(timeout_s)
                if probe.connect_ex((str(ip), port)) == 0:
                    reachable.append(str(ip))
    return {"port": port, "checked": checked, "reachable_on": reachable, "exposed": bool(reachable)}


def port_lines(result: dict[str, Any]) -> list[str]:
    """One line per worker: where its unauthenticated TF port answers."""
    lines = []
    for report in result["workers"]:
        exposure = report.get("worker_port")
        if not exposure:
            continue
        where = f"rank {report['rank']} on {report['host']}: worker port {exposure['port']}"
        if exposure["exposed"]:
            lines.append(f"WARNING: {where} answers on non-loopback {', '.join(exposure['reachable_on'])}: "
                         "anyone who can reach it can run code as this user; keep worker ports private "
                         "(docs/security.md)")
        else:
            lines.append(f"{where}: not reachable on non-loopback addresses "
                         f"({', '.join(exposure['checked']) or 'none on this host'})")
    return lines


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"PREFLIGHT {result['status'].upper()}: {result['num_workers']} worker(s), {result['wall_time_s']:.1f} s",
             (f"{'rank':<5}{'host':<16}{'python':<9}{'tensorflow':<12}{'tf-keras':<10}{'transformers':<14}"
              f"{'gpus':<14}{'disk free':>11}  manifest storage")]
    for report in result["workers"]:
        versions, gpus = report["versions"], report["devices"]["gpus"]
        devices = ",".join(f"{g['index']}:{g['memory_free_mb']}MB" for g in gpus) or "cpu"
        lines.append(f"{report['rank']:<5}{report['host'][:15]:<16}{versions['python']:<9}{versions['tensorflow']:<12}"
                     f"{versions['tf-keras']:<10}{versions['transformers']:<14}{devices:<14}"
                     f"{report['disk']['free_bytes'] / 2**30:>8.1f} GiB  "
                     f"{'ok' if report['manifest']['ok'] else 'FAIL':<9}{'ok' if report['storage']['ok'] else 'FAIL'}")
    collectives = result.get("collectives") or {}
    if "all_reduce" in collectives:
        ar, bc = collectives["all_reduce"], collectives["broadcast"]
        lines.append(f"all-reduce: expected {ar['expected']} got {ar['got']} -> {'ok' if ar['ok'] else 'WRONG'}; "
                     f"broadcast from chief -> {'ok' if bc['ok'] else 'WRONG'}")
        bw, lat = collectives["bandwidth"], collectives["latency"]
        lines.append(f"bandwidth: {bw['bytes'] >> 20} MiB all-reduce, median of {bw['iterations']}: "
                     f"{bw['median_s'] * 1e3:.1f} ms, algbw {bw['algbw_gbps']:.3f} GB/s, "
                     f"busbw {bw['busbw_gbps']:.3f} GB/s; latency ({lat['bytes']} B) p50 {lat['p50_ms']:.2f} ms, "
                     f"max {lat['max_ms']:.2f} ms")
    lines += port_lines(result)
    advice = result.get("advisor") or {}
    if advice.get("rows"):
        from trainer.advisor import table_lines

        lines.append(f"scaling advisor (single-worker step from the {advice['inputs']['step_source']}, gradients "
                     f"{advice['inputs']['gradient_bytes'] / 2**20:.1f} MiB):")
        lines += ["  " + line for line in table_lines(advice)]
    elif advice.get("skipped"):
        lines.append(f"scaling advisor: {advice['skipped']}")
    lines += [f"ERROR: {error}" for error in result["errors"]]
    return lines


# -- the collective phase, in a child process ------------------------------------------------------------------

PHASE_FILE = "phase"
RESULT_FILE = "collectives.json"
REPORT_FILE = "report.json"


def _set_phase(scratch: str, phase: str) -> None:
    with open(os.path.join(scratch, PHASE_FILE), "w", encoding="utf-8") as handle:
        handle.write(phase)


def collectives_main(scratch: str, cfg: RunConfig, output: str) -> int:
    """Child: join the group, run the collectives, add them to this rank's report, wait for every rank.

    A separate process because TensorFlow can block inside the strategy's rendezvous while holding the GIL: no
    thread or signal handler of this interpreter would run. The parent enforces the deadline by killing us.
    """
    import tensorflow as tf

    identity = runtime.worker_identity()
    _set_phase(scratch, "rendezvous (creating MultiWorkerMirroredStrategy)")
    try:
        strategy = create_strategy(cfg)
        runtime.signal_ready()
        exposure = port_exposure(identity)  # the TF server listens from here on
        _set_phase(scratch, "all-reduce, broadcast and bandwidth probe")
        collectives = run_collectives(strategy, identity.rank, identity.num_workers)
        report = storage.read_json(os.path.join(scratch, REPORT_FILE))
        storage.write_json_atomic(PreflightOutput(output).rank_report(identity.rank),
                                  {**report, "collectives": collectives, "worker_port": exposure})
        _set_phase(scratch, "waiting for every rank's report")
        wait_for_every_rank(output, identity)
    except tf.errors.OpError as error:  # Unavailable, DeadlineExceeded, Internal, Cancelled, ...
        result: dict[str, Any] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    else:
        result = {"collectives": collectives, "worker_port": exposure}
    storage.write_json_atomic(os.path.join(scratch, RESULT_FILE), result)
    return 0 if "collectives" in result else EXIT_COLLECTIVES_FAILED


# -- the worker's main process ----------------------------------------------------------------------------------

class Preflight:
    def __init__(self, cfg: RunConfig, config_url: str, manifest_url: str, output: str,
                 baseline_summary: str | None = None) -> None:
        self.cfg, self.config_url, self.manifest_url, self.output = cfg, config_url, manifest_url, output
        self.baseline_summary = baseline_summary
        self.identity = runtime.worker_identity()
        self.started, self.started_at = time.perf_counter(), utc_now()

    def run(self) -> int:
        report = {**check_worker(self.cfg, self.manifest_url, self.identity), "group_id": group_id(self.identity)}
        for error in report["errors"]:
            log.error("%s", error)
        self._write_rank_report(report)
        if self.identity.num_workers == 1:
            runtime.signal_ready()
            return self._conclude(report, {"skipped": "one worker"})
        with tempfile.TemporaryDirectory(prefix=f"preflight-rank{self.identity.rank}-") as scratch:
            storage.write_json_atomic(os.path.join(scratch, REPORT_FILE), report)
            phase, outcome, collective_s = self._run_child(scratch)
        if "collectives" not in outcome:
            return self._collectives_failed(phase, outcome["error"], collective_s)
        return self._conclude({**report, "worker_port": outcome["worker_port"]}, outcome["collectives"])

    def _run_child(self, scratch: str) -> tuple[str, dict[str, Any], float]:
        """Run the collective phase; past `collective_timeout_s` after the rendezvous began, kill it.

        Returns the last phase reached, the child's result (or error) and the seconds since the rendezvous began.
        """
        child = subprocess.Popen([sys.executable, "-m", "trainer.selftest", "--config", self.config_url,
                                  "--manifest", self.manifest_url, "--output", self.output,
                                  "--collectives-in", scratch])
        phase, began = "start-up (importing TensorFlow)", None
        phase_file = os.path.join(scratch, PHASE_FILE)
        try:
            while child.poll() is None:
                if os.path.exists(phase_file):
                    with open(phase_file, encoding="utf-8") as handle:
                        phase = handle.read() or phase
                    # Importing TensorFlow is bounded by the launcher's startup timeout, the rest by ours.
                    began = began or time.monotonic()
                if began and time.monotonic() - began > self.cfg.collective_timeout_s:
                    return phase, {"error": f"no progress within {self.cfg.collective_timeout_s} s"}, \
                        time.monotonic() - began
                time.sleep(0.1)
        finally:
            if child.poll() is None:
                child.kill()  # past its deadline: no grace
                child.wait()
        elapsed = time.monotonic() - began if began else 0.0
        try:
            return phase, storage.read_json(os.path.join(scratch, RESULT_FILE)), elapsed
        except FileNotFoundError:
            return phase, {"error": f"the collective process exited with status {child.returncode} (see above)"}, \
                elapsed

    def _write_rank_report(self, report: dict[str, Any]) -> None:
        try:
            storage.write_json_atomic(PreflightOutput(self.output).rank_report(self.identity.rank), report)
        except Exception as error:  # noqa: BLE001 - check_worker's storage probe reports the cause
            log.error("rank %d: cannot write its preflight report to %s: %s", self.identity.rank, self.output, error)

    def _collectives_failed(self, phase: str, error: str, collective_s: float) -> int:
        reports = read_rank_reports(self.output, self.identity)
        message, probes = collective_failure_message(phase, error, self.identity, reports,
                                                     self.cfg.collective_timeout_s)
        log.error("rank %d on %s: %s", self.identity.rank, self.identity.host, message)
        if self.identity.is_chief:
            # Mismatched versions are a common reason for collectives that never complete.
            self._write_result(reports, errors=[message, *version_skew(reports)], collectives=None,
                               extra={"answered": sorted(reports), "probes": probes,
                                      "failed_after_s": collective_s,
                                      "missing": [r for r in range(self.identity.num_workers) if r not in reports]})
        else:
            self._wait_for_chief_report()
        return EXIT_COLLECTIVES_FAILED

    def _wait_for_chief_report(self) -> None:
        url = PreflightOutput(self.output).result
        deadline = time.monotonic() + CHIEF_REPORT_WAIT_S
        while time.monotonic() < deadline:
            try:
                if storage.read_json(url).get("group_id") == group_id(self.identity):
                    return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.5)

    def _conclude(self, report: dict[str, Any], collectives: dict[str, Any]) -> int:
        own_errors = list(report["errors"])
        if "all_reduce" in collectives:
            if not collectives["all_reduce"]["ok"]:
                own_errors.append(f"all-reduce gave {collectives['all_reduce']['got']}, expected "
                                  f"{collectives['all_reduce']['expected']}: rank(s) "
                                  f"{collectives['all_reduce']['wrong_ranks']} missing or wrong in the sum")
            if not collectives["broadcast"]["ok"]:
                own_errors.append(f"rank {self.identity.rank}: broadcast from the chief gave "
                                  f"{collectives['broadcast']['got']}, expected {collectives['broadcast']['expected']}")
        if not self.identity.is_chief:
            if own_errors:
                self._wait_for_chief_report()
                return EXIT_CHECKS_FAILED
            return 0
        reports = read_rank_reports(self.output, self.identity)
        reports[self.identity.rank] = {**report, "collectives": collectives}
        errors = [e for r in sorted(reports) if r != self.identity.rank for e in reports[r]["errors"]]
        missing = [r for r in range(self.identity.num_workers) if r not in reports]
        if missing:
            errors.append(f"rank(s) {missing} passed the collectives but left no report under {self.output}: "
                          "check their storage access in the task log")
        errors = own_errors + errors + version_skew(reports)
        extra = {}
        if "bandwidth" in collectives and not errors:
            extra["advisor"] = self._advise(collectives, reports)
            gate = extra["advisor"].get("error")
            if gate:
                errors.append(gate)
        result = self._write_result(reports, errors=errors, collectives=collectives, extra=extra)
        return EXIT_CHECKS_FAILED if result["errors"] else 0

    def _advise(self, collectives: dict[str, Any], reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """The scaling advisor's prediction (trainer/advisor.py) from the measured collectives and one worker's
        step time: the reused baseline's, else a few-step probe in a child process without TF_CONFIG (the
        other ranks have finished, so on a CPU the probe has the host's cores as the baseline will)."""
        from trainer import advisor

        step = None
        if self.baseline_summary and storage.exists(self.baseline_summary):
            step = advisor.step_from_summary(storage.read_json(self.baseline_summary))
        if step is None:
            with tempfile.TemporaryDirectory(prefix="preflight-probe-") as scratch:
                out = os.path.join(scratch, "probe.json")
                env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
                started = time.perf_counter()
                probe = subprocess.run([sys.executable, "-m", "trainer.advisor", "--config", self.config_url,
                                        "--manifest", self.manifest_url, "--out", out], env=env, check=False)
                if probe.returncode != 0 or not os.path.exists(out):
                    reason = (f"the single-worker probe exited with status {probe.returncode} (see above), so there "
                              "is no scaling prediction")
                    log.warning("%s", reason)
                    # Without a prediction the gate cannot pass: it must not let an unknown efficiency through.
                    return {"error": reason if self.cfg.min_predicted_efficiency else None, "skipped": reason}
                step = storage.read_json(out)
                log.info("advisor probe: %d single-worker steps of the global batch, median %.1f ms (%.1f s in all)",
                         step["steps"], step["seconds_per_step"] * 1e3, time.perf_counter() - started)
        advice = advisor.advise(cfg=self.cfg, collectives=collectives,
                                workers=[reports[r] for r in sorted(reports)], step=step)
        return {**advice, "error": advisor.efficiency_error(advice)}

    def _write_result(self, reports: dict[int, dict[str, Any]], *, errors: list[str],
                      collectives: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        result = {
            "status": "failed" if errors else "passed",
            "num_workers": self.identity.num_workers,
            "group_id": group_id(self.identity),
            "started_at": self.started_at,
            "finished_at": utc_now(),
            "wall_time_s": time.perf_counter() - self.started,
            "errors": errors,
            "workers": [reports[r] for r in sorted(reports)],
            "collectives": collectives,
            "config": self.cfg.to_dict(),
            **(extra or {}),
        }
        url = PreflightOutput(self.output).result
        storage.write_json_atomic(url, result)
        print("\n".join(summary_lines(result)), flush=True)
        live = live_values(result)
        if live:
            print_live_line("preflight", live)
        log.info("preflight report written to %s", url)
        return result


def live_values(result: dict[str, Any]) -> dict[str, float]:
    """The figures of a preflight that Airflow's metrics carry (tasks/telemetry.py, scope "preflight")."""
    collectives = result.get("collectives") or {}
    values = {}
    if "bandwidth" in collectives:
        values["busbw_gbps"] = collectives["bandwidth"]["busbw_gbps"]
    if "latency" in collectives:
        values["latency_p50_ms"] = collectives["latency"]["p50_ms"]
    rows = {row["num_workers"]: row for row in (result.get("advisor") or {}).get("rows") or ()}
    row = rows.get(result["num_workers"])
    if row:
        values.update(predicted_speedup=row["speedup"], predicted_efficiency=row["efficiency"],
                      predicted_tokens_per_s=row["tokens_per_s"])
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="RunConfig JSON (path or URL)")
    parser.add_argument("--manifest", required=True, help="manifest.json of the tokenized dataset")
    parser.add_argument("--output", required=True, help="the run's report directory (path or URL)")
    parser.add_argument("--baseline-summary", help="the matching baseline's summary.json: its step time feeds the "
                                                   "scaling advisor when it exists (else a few-step probe)")
    parser.add_argument("--collectives-in", help=argparse.SUPPRESS)  # internal: the child's scratch directory
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    identity = runtime.worker_identity()
    configure_worker_logging(logging.INFO, f"%(asctime)s rank{identity.rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # one INFO line per collective otherwise
    try:
        cfg = RunConfig.from_saved(storage.read_json(args.config))
    except (OSError, ValueError) as error:  # ConfigError is a ValueError
        log.error("rank %d on %s: cannot read the run configuration %s: %s", identity.rank, identity.host,
                  args.config, error)
        return EXIT_CHECKS_FAILED
    if args.collectives_in:
        return collectives_main(args.collectives_in, cfg, args.output)
    return Preflight(cfg, args.config, args.manifest, args.output, args.baseline_summary).run()


if __name__ == "__main__":
    sys.exit(main())
