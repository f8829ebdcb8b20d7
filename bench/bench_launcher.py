"""Launch overhead: a tiny 2-worker MultiWorkerMirroredStrategy training job started by the launcher
(`WorkerGroup` + `LocalBackend`: ports, TF_CONFIG, process groups, ready files, rank-prefixed log streaming, stop
sweep) against the same two processes started by hand with hand-written TF_CONFIG (the floor).

Runs alternate floor / launcher so both see the same machine load. The best of each (the run least disturbed by
other load on a shared machine) is compared, the medians are printed too. Target: <= 1.15x.
This module is also the job itself: `python -m bench.bench_launcher --worker`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPEATS = 3
STEPS = 10
TARGET_RATIO = 1.15


def _job() -> None:
    """The worker: MWMS over TF_CONFIG, a small two-layer model in core TF, STEPS SGD steps of all-reduced gradients."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()
    import numpy as np
    import tensorflow as tf

    from trainer.runtime import signal_ready, worker_identity

    me = worker_identity()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    signal_ready()
    x = np.random.default_rng(me.rank).normal(size=(512, 32)).astype("float32")
    batches = iter(tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True))).repeat().batch(16))
    with strategy.scope():
        hidden = tf.Variable(tf.random.stateless_normal([32, 64], seed=[0, 0], stddev=0.1), name="hidden")
        output = tf.Variable(tf.random.stateless_normal([64, 1], seed=[0, 1], stddev=0.1), name="output")

    @tf.function
    def step(features, targets):
        def replica_step(features, targets):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.nn.relu(features @ hidden) @ output - targets))
            gradients = tf.distribute.get_replica_context().all_reduce("mean", tape.gradient(loss, [hidden, output]))
            for variable, gradient in zip((hidden, output), gradients):
                variable.assign_sub(0.01 * gradient)
            return loss

        return strategy.reduce("mean", strategy.run(replica_step, args=(features, targets)), axis=None)

    for _ in range(args.steps):
        loss = step(*next(batches))
    print(f"rank {me.rank}: {args.steps} steps, loss {float(loss):.4f}", flush=True)


def _worker_env() -> dict[str, str]:
    return {"PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3"}


def _command() -> list[str]:
    return [sys.executable, "-u", "-m", "bench.bench_launcher", "--worker", "--steps", str(STEPS)]


def _by_hand(workdir: Path) -> float:
    """The floor: two Popen calls with a hand-written TF_CONFIG, then wait for both."""
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    workers = [f"127.0.0.1:{port}" for port in ports]
    started = time.monotonic()
    processes = []
    for rank in range(2):
        tf_config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})
        cwd = workdir / f"hand-{rank}"
        cwd.mkdir(parents=True, exist_ok=True)
        processes.append(subprocess.Popen(_command(), cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          env={**os.environ, **_worker_env(), "TF_CONFIG": tf_config,
                                               "CUDA_VISIBLE_DEVICES": ""}))
    codes = [process.wait() for process in processes]
    elapsed = time.monotonic() - started
    if codes != [0, 0]:
        raise RuntimeError(f"hand-launched workers exited with {codes}")
    return elapsed


def _launcher(workdir: Path) -> float:
    from launcher import GroupSpec, LocalBackend, WorkerGroup

    spec = GroupSpec(name="bench", entrypoint="bench.bench_launcher", args=("--worker", "--steps", str(STEPS)),
                     num_workers=2, env=_worker_env(), startup_timeout_s=120, hang_timeout_s=120)
    started = time.monotonic()
    result = WorkerGroup(spec, LocalBackend(), workdir, on_line=lambda rank, line: None).run()
    elapsed = time.monotonic() - started
    if not result.succeeded:
        raise RuntimeError(result.error_message())
    return elapsed


def run(out_dir: Path) -> dict:
    logging.getLogger("launcher").setLevel(logging.WARNING)
    floor, launcher = [], []
    with tempfile.TemporaryDirectory(prefix="bench-launcher-") as tmp:
        for repeat in range(REPEATS):
            floor.append(_by_hand(Path(tmp) / f"hand-{repeat}"))
            launcher.append(_launcher(Path(tmp) / f"launcher-{repeat}"))
            print(f"  run {repeat + 1}/{REPEATS}: by hand {floor[-1]:.2f} s, launcher {launcher[-1]:.2f} s", flush=True)
    best_ratio = min(launcher) / min(floor)
    median_ratio = statistics.median(launcher) / statistics.median(floor)
    print(f"tiny 2-worker MWMS job ({STEPS} steps, CPU), {REPEATS} runs each: best by hand {min(floor):.2f} s, "
          f"best launcher {min(launcher):.2f} s -> {best_ratio:.3f}x the floor (medians: {median_ratio:.3f}x); "
          f"target <= {TARGET_RATIO}x: {'OK' if best_ratio <= TARGET_RATIO else 'ABOVE TARGET'}")
    return {"steps": STEPS, "repeats": REPEATS, "by_hand_s": floor, "launcher_s": launcher,
            "ratio_best": best_ratio, "ratio_median": median_ratio, "target_ratio": TARGET_RATIO,
            "rows": [{"benchmark": "launcher: tiny 2-worker job via the operator's launcher vs the same processes by "
                                   "hand",
                      "measured": f"{best_ratio:.2f}x (best of {REPEATS}; median {median_ratio:.2f}x)",
                      "target": f"<= {TARGET_RATIO}x"}]}

if __name__ == "__main__":
    _job()
