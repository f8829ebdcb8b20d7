"""The collectives, as training runs them: an all-reduce whose exact answer names every rank (rank r contributes
r + 1 at index r, so the sum must be [1, 2, ..., N]), a broadcast (MWMS copies the chief's initial variable values
to every worker, as it does for model weights), a bandwidth probe (algorithm bandwidth = bytes / time of one
all-reduce, bus bandwidth = algbw * 2(N-1)/N) and small-message latency.

They run in a child process, which the worker kills `collective_timeout_s` after the rendezvous began: TensorFlow
can block inside the strategy's rendezvous while holding the GIL, so no thread or signal handler of the worker's
own interpreter would run, and the launcher, which would end it later, cannot say which ranks answered. The
phase reached and the result travel through files in a scratch directory.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import statistics
import subprocess
import time
from typing import Any

from core import storage
from core.config import RunConfig
from core.layout import PreflightOutput
from trainer import runtime
from trainer.allreduce import communication_options
from trainer.preflight.verdict import EXIT_COLLECTIVES_FAILED, group_id
from trainer.strategy import create_strategy

BANDWIDTH_BYTES = 8 << 20
BANDWIDTH_ITERATIONS = 5
LATENCY_ITERATIONS = 20
PHASE_FILE = "phase"
RESULT_FILE = "collectives.json"
REPORT_FILE = "report.json"


def _all_reduce_fn(strategy, cfg: RunConfig):
    """An all-reduce as the gradients' (trainer/allreduce.py): the same options, so the same implementation."""
    import numpy as np
    import tensorflow as tf

    options = communication_options(cfg)

    @tf.function
    def reduce(value):
        def replica(v):
            # identity places the input on this replica's device; the bare function input has none
            return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, tf.identity(v),
                                                                  options=options)

        return strategy.run(replica, args=(value,))

    def call(value) -> Any:
        return strategy.experimental_local_results(reduce(value))[0].numpy().astype(np.float32)

    return call


def run_collectives(strategy, rank: int, num_workers: int, cfg: RunConfig) -> dict[str, Any]:
    """The collectives, the all-reduces in `cfg`'s wire dtype (`allreduce_dtype`) over its implementation: a pair
    the collective cannot carry fails here, not at training's first step. bfloat16 holds the sum's integers exactly
    up to 256 (num_workers is at most 64)."""
    import numpy as np
    import tensorflow as tf

    all_reduce, wire = _all_reduce_fn(strategy, cfg), tf.as_dtype(cfg.allreduce_dtype)
    contribution = np.zeros(num_workers, dtype=np.float32)
    contribution[rank] = rank + 1
    got = all_reduce(tf.constant(contribution, dtype=wire))
    expected = np.arange(1, num_workers + 1, dtype=np.float32)
    wrong = [r for r in range(num_workers) if got[r] != expected[r]]
    results: dict[str, Any] = {"all_reduce": {"expected": expected.tolist(), "got": got.tolist(), "ok": not wrong,
                                              "wrong_ranks": wrong, "dtype": wire.name,
                                              "implementation": cfg.collective_implementation}}

    with strategy.scope():
        # MWMS broadcasts the chief's initial value to every worker: rank 0's pattern must arrive everywhere.
        variable = tf.Variable(np.arange(4, dtype=np.float32) + 100.0 * (rank + 1))
    seen = variable.numpy()
    chief_value = np.arange(4, dtype=np.float32) + 100.0
    results["broadcast"] = {"expected": chief_value.tolist(), "got": seen.tolist(),
                            "ok": bool(np.array_equal(seen, chief_value))}

    payload = tf.ones(BANDWIDTH_BYTES // wire.size, dtype=wire)
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

    tiny = tf.ones(1, dtype=wire)
    all_reduce(tiny)
    latencies = []
    for _ in range(LATENCY_ITERATIONS):
        started = time.perf_counter()
        all_reduce(tiny)
        latencies.append(time.perf_counter() - started)
    results["latency"] = {"bytes": wire.size, "iterations": LATENCY_ITERATIONS,
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


# -- the collective phase, in a child process ------------------------------------------------------------------


def _set_phase(scratch: str, phase: str) -> None:
    with open(os.path.join(scratch, PHASE_FILE), "w", encoding="utf-8") as handle:
        handle.write(phase)


def collectives_main(scratch: str, cfg: RunConfig, output: str) -> int:
    """Child: join the group, run the collectives, add them to this rank's report, wait for every rank."""
    import tensorflow as tf

    identity = runtime.worker_identity()
    _set_phase(scratch, "rendezvous (creating MultiWorkerMirroredStrategy)")
    try:
        strategy = create_strategy(cfg, multi_worker=True, collective_timeout_s=cfg.collective_timeout_s)
        runtime.signal_ready()
        exposure = port_exposure(identity)  # the TF server listens from here on
        _set_phase(scratch, f"all-reduce of {cfg.allreduce_dtype} over {cfg.collective_implementation} (as training: "
                            "settings 'allreduce_dtype' and 'communication'), broadcast and bandwidth probe")
        collectives = run_collectives(strategy, identity.rank, identity.num_workers, cfg)
        report = storage.read_json(os.path.join(scratch, REPORT_FILE))
        storage.write_json_atomic(PreflightOutput(output).rank_report(identity.rank),
                                  {**report, "collectives": collectives, "worker_port": exposure})
        _set_phase(scratch, "waiting for every rank's report")
        wait_for_every_rank(output, identity)
    # OpError: Unavailable, DeadlineExceeded, Internal, Cancelled, ...; RuntimeError: use_gpu without a GPU.
    except (tf.errors.OpError, RuntimeError) as error:
        result: dict[str, Any] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
    else:
        result = {"collectives": collectives, "worker_port": exposure}
    storage.write_json_atomic(os.path.join(scratch, RESULT_FILE), result)
    return 0 if "collectives" in result else EXIT_COLLECTIVES_FAILED


def run_collective_phase(command: list[str], scratch: str, timeout_s: float) -> tuple[str, dict[str, Any], float]:
    """Run `command` (the child, `collectives_main`); past `timeout_s` after the rendezvous began, kill it.

    Returns the last phase reached, the child's result (or error) and the seconds since the rendezvous began.
    """
    child = subprocess.Popen(command)
    phase, began = "start-up (importing TensorFlow)", None
    phase_file = os.path.join(scratch, PHASE_FILE)
    try:
        while child.poll() is None:
            if os.path.exists(phase_file):
                with open(phase_file, encoding="utf-8") as handle:
                    phase = handle.read() or phase
                # Importing TensorFlow is bounded by the launcher's startup timeout, the rest by ours.
                began = began or time.monotonic()
            if began and time.monotonic() - began > timeout_s:
                return phase, {"error": f"no progress within {timeout_s:g} s"}, time.monotonic() - began
            time.sleep(0.1)
    finally:
        if child.poll() is None:
            child.kill()  # past its deadline: no grace
            child.wait()
    elapsed = time.monotonic() - began if began else 0.0
    try:
        return phase, storage.read_json(os.path.join(scratch, RESULT_FILE)), elapsed
    except FileNotFoundError:
        return phase, {"error": f"the collective process exited with status {child.returncode} (see above)"}, elapsed
