"""Benchmarks (`make bench`) and the GPU check; see bench/__main__.py."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The 42 Shakespeare plays next to the repository (../shared/data/shakespeare), or where $BENCH_CORPUS points.
CORPUS = Path(os.environ.get("BENCH_CORPUS") or REPO.parent / "shared" / "data" / "shakespeare")

