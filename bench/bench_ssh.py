"""SSH launch overhead: the same tiny 2-worker MultiWorkerMirroredStrategy job (bench/bench_launcher.py's) on the
local backend and on the SSH backend across two real OpenSSH hosts on 127.0.0.2 and 127.0.0.3 (tests/support/sshd.py;
connections, host-key checks, one agent per rank, placement probes and the remote stop included).

Runs alternate local / SSH so both see the same machine load; best and median ratios are printed. Target: SSH
<= 1.3x the local wall time. Needs /usr/sbin/sshd (`make provision` installs it as root).
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.bench_launcher import STEPS, _worker_env

REPEATS = 3
TARGET_RATIO = 1.3


def _group(backend, workdir: Path) -> float:
    from launcher import GroupSpec, WorkerGroup

    spec = GroupSpec(name="bench", entrypoint="bench.bench_launcher", args=("--worker", "--steps", str(STEPS)),
                     num_workers=2, env=_worker_env(), startup_timeout_s=120, hang_timeout_s=120, run_key="bench-ssh")
    started = time.monotonic()
    try:
        result = WorkerGroup(spec, backend, workdir, on_line=lambda rank, line: None).run()
    finally:
        backend.close()
    elapsed = time.monotonic() - started
    if not result.succeeded:
        raise RuntimeError(result.error_message())
    return elapsed


def run(out_dir: Path) -> dict:
    from tf_multiworker.backends import ssh_backend

    from launcher import LocalBackend
    from tests.support.sshd import start_hosts, stop_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise RuntimeError(f"no SSH hosts: {reason}")
    logging.getLogger("launcher").setLevel(logging.WARNING)
    local, remote = [], []
    with tempfile.TemporaryDirectory(prefix="bench-ssh-") as tmp:
        (Path(tmp) / "hosts").mkdir()
        hosts = start_hosts(2, Path(tmp) / "hosts")
        try:
            for host in hosts:
                os.environ.update(host.connection_env())
            settings = {"ssh_conn_ids": [host.conn_id for host in hosts]}
            for repeat in range(REPEATS):
                local.append(_group(LocalBackend(), Path(tmp) / f"local-{repeat}"))
                remote.append(_group(ssh_backend(settings), Path(tmp) / f"ssh-{repeat}"))
                print(f"  run {repeat + 1}/{REPEATS}: local {local[-1]:.2f} s, ssh {remote[-1]:.2f} s", flush=True)
        finally:
            stop_hosts(hosts)
    best_ratio = min(remote) / min(local)
    median_ratio = statistics.median(remote) / statistics.median(local)
    print(f"tiny 2-worker MWMS job ({STEPS} steps, CPU), {REPEATS} runs each: best local {min(local):.2f} s, best "
          f"ssh (2 hosts) {min(remote):.2f} s -> {best_ratio:.3f}x (medians: {median_ratio:.3f}x); "
          f"target <= {TARGET_RATIO}x: {'OK' if best_ratio <= TARGET_RATIO else 'ABOVE TARGET'}")
    return {"steps": STEPS, "repeats": REPEATS, "local_s": local, "ssh_s": remote, "ratio_best": best_ratio,
            "ratio_median": median_ratio, "target_ratio": TARGET_RATIO,
            "rows": [{"benchmark": "ssh: tiny 2-worker job on two SSH hosts (loopback sshd) vs the local backend",
                      "measured": f"{best_ratio:.2f}x (best of {REPEATS}; median {median_ratio:.2f}x)",
                      "target": f"<= {TARGET_RATIO}x"}]}
