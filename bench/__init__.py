"""Benchmarks (`make bench`) and the GPU check; see bench/__main__.py."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The 42 Shakespeare plays next to the repository (../shared/data/shakespeare), or where $BENCH_CORPUS points.
CORPUS = Path(os.environ.get("BENCH_CORPUS") or REPO.parent / "shared" / "data" / "shakespeare")


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on loopback right now (bound to port 0, then released)."""
    import socket

    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
