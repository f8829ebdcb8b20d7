"""A tiny stand-in for a training worker: binds its TF_CONFIG port like a gRPC server, signals ready, then runs
steps that each end in a barrier with rank 0 (a socket stand-in for a collective), printing one line per step.

Faults for tests, from TINY_WORKER_FAULT="<rank>:<mode>":
  exit<N>      exit with code N at step 2 (exit1, exit65: not retryable, exit75: preempted)
  sigkill      SIGKILL itself at step 2
  hang         stop taking part in the barrier at step 2 (every peer then blocks, silent)
  never_ready  never bind, never signal ready, print nothing more
TINY_WORKER_SHOW_ENV names a variable whose presence (never its value) is printed; TINY_WORKER_ECHO_ENV one whose
value is printed (to test redaction).
TINY_WORKER_TEMP=1 prints how many entries its temporary directory held at start, then leaves a file there (as
a worker ended by a signal leaves its temporary files).
TINY_WORKER_BLOCKED_ON_TERM=1: a rank whose peer went away outlives SIGTERM, as the trainer's rank blocked in a
collective with a dead peer does (its preemption notice waits for a step that never comes); the launcher's
ABORT_SIGNAL still ends it.
TINY_WORKER_CHECKPOINT_ON_TERM=<dir>: SIGTERM is a preemption notice, as in the trainer's loop: the rank writes
`<dir>/rank-<r>-step-<k>` (k: its last step) and exits 75 (EXIT_PREEMPTED).
TINY_WORKER_STEPS (default 5) and TINY_WORKER_STEP_S (default 0.05) set the length of the run.
TINY_WORKER_LIVE_STEPS=k also prints the trainer's live metrics line after every step, its step frozen at k - 1 from
step k on (a rank that talks but no longer trains, for the idle-held warning). Every worker also
starts a `sleep` child in its process group, so tests can see that the whole group is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from core.protocol import EXIT_PREEMPTED
from trainer.metrics import LIVE_PREFIX
from trainer.runtime import signal_ready, worker_identity

FOREVER_S = 3600


def _fault_for(rank: int) -> str:
    spec = os.environ.get("TINY_WORKER_FAULT", "")
    if not spec:
        return ""
    fault_rank, mode = spec.split(":")
    return mode if int(fault_rank) == rank else ""


def _connect(address: str, timeout_s: float = 30.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=FOREVER_S)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _peer_gone() -> None:
    if os.environ.get("TINY_WORKER_BLOCKED_ON_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("peer went away; waiting as a collective would", flush=True)
    time.sleep(FOREVER_S)


def _recv_exact(conn: socket.socket) -> None:
    try:
        received = conn.recv(1)
    except ConnectionError:  # a peer that died mid-step resets the connection instead of closing it
        received = b""
    if not received:
        _peer_gone()


def _send(conn: socket.socket) -> None:
    try:
        conn.sendall(b"s")
    except ConnectionError:  # the peer is gone: EPIPE or a reset, depending on when it died
        _peer_gone()


def _show_environment() -> None:
    """What TINY_WORKER_SHOW_ENV, TINY_WORKER_ECHO_ENV and TINY_WORKER_TEMP ask to see."""
    shown = os.environ.get("TINY_WORKER_SHOW_ENV")
    if shown:
        print(f"{shown} is {'set' if os.environ.get(shown) else 'not set'}", flush=True)
    echoed = os.environ.get("TINY_WORKER_ECHO_ENV")
    if echoed:
        print(f"{echoed}={os.environ.get(echoed)}", flush=True)
    if os.environ.get("TINY_WORKER_TEMP"):
        temp = tempfile.gettempdir()
        print(f"temp dir {temp} held {len(os.listdir(temp))} entries; host temp {os.environ.get('TFMW_HOST_TMPDIR')}",
              flush=True)
        os.close(tempfile.mkstemp(prefix="left-behind-")[0])


def _fault_at_step_2(fault: str) -> int | None:
    """Exit 1, die by SIGKILL or hang, as `fault` asks; the exit code for main to return, if any."""
    if fault.startswith("exit") and fault[4:].isdigit():
        print(f"failing on purpose with exit code {fault[4:]}", flush=True)
        return int(fault[4:])
    if fault == "sigkill":
        print("killing myself with SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        time.sleep(FOREVER_S)
    return None


def _checkpoint_on_sigterm(directory: str, rank: int, steps_done: list[int]) -> None:
    def save_and_exit(signum, frame) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"rank-{rank}-step-{len(steps_done)}"), "w") as checkpoint:
            checkpoint.write("saved on SIGTERM\n")
        print(f"rank {rank}: checkpoint of step {len(steps_done)} saved on SIGTERM", flush=True)
        os._exit(EXIT_PREEMPTED)

    signal.signal(signal.SIGTERM, save_and_exit)


def main() -> int:
    me = worker_identity()
    steps_done: list[int] = []
    if os.environ.get("TINY_WORKER_CHECKPOINT_ON_TERM"):
        _checkpoint_on_sigterm(os.environ["TINY_WORKER_CHECKPOINT_ON_TERM"], me.rank, steps_done)
    fault = _fault_for(me.rank)
    print(f"rank {me.rank} of {me.num_workers} pid {os.getpid()} pgid {os.getpgid(0)} starting", flush=True)
    _show_environment()
    subprocess.Popen(["sleep", str(FOREVER_S)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if fault == "never_ready":
        time.sleep(FOREVER_S)
    host, port = me.addresses[me.rank].rsplit(":", 1)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As gRPC's server does: a port whose earlier listener's connections are in TIME_WAIT can be bound again (a
    # retry's pod of the same name gets the same port here), one with a live listener cannot.
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((host, int(port)))  # an occupied port raises "Address already in use" here, as gRPC reports it
    server.listen(me.num_workers)
    print(f"rank {me.rank} listening on {host}:{port}", flush=True)
    signal_ready()
    if me.rank == 0:
        peers = [server.accept()[0] for _ in range(me.num_workers - 1)]
    else:
        chief = _connect(me.addresses[0])
    steps = int(os.environ.get("TINY_WORKER_STEPS", "5"))
    step_s = float(os.environ.get("TINY_WORKER_STEP_S", "0.05"))
    for step in range(steps):
        exit_code = _fault_at_step_2(fault) if step == 2 else None
        if exit_code is not None:
            return exit_code
        time.sleep(step_s)
        if me.rank == 0:
            for peer in peers:
                _recv_exact(peer)
            for peer in peers:
                _send(peer)
        else:
            _send(chief)
            _recv_exact(chief)
        print(f"rank {me.rank} step {step} done", flush=True)
        steps_done.append(step)
        if os.environ.get("TINY_WORKER_LIVE_STEPS"):
            frozen = min(step, int(os.environ["TINY_WORKER_LIVE_STEPS"]) - 1)
            print(LIVE_PREFIX + json.dumps({"scope": "worker", "values": {"step": frozen}}), flush=True)
    print(f"rank {me.rank} finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
