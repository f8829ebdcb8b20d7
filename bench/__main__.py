"""`make bench`: every benchmark of the project, each printing ratios measured side by side in one run.

Usage: python -m bench [NAME ...]   (names: the bench_<name>.py modules; default all)
Results: bench-results/<name>.json (latest) and bench-results/history/ (every run), each with the machine it ran
on, plus the printed lines; then the benchmark table in docs/benchmarks.md is regenerated from them (bench/results.py).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import tempfile
import time
from pathlib import Path

import bench
from bench import results

OUT = results.RESULTS


def main(names: list[str]) -> int:
    names = [name.replace("-", "_") for name in names]  # `BENCH_ARGS=prepare-scale` names bench_prepare_scale
    here = [str(Path(__file__).parent)]  # run as __main__, the module has no package __path__
    available = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(here) if m.name.startswith("bench_"))
    chosen = names or available
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        print(f"Unknown benchmark(s) {unknown}; available: {available}")
        return 2
    OUT.mkdir(exist_ok=True)
    # The benchmarks read the shared corpus and write to temporary directories: allow both (core/config/access.py).
    repo = OUT.parent
    os.environ.setdefault("GPT_FINETUNE_DATA_ROOTS", os.pathsep.join(
        [str(repo / "data"), str(repo / "storage"), str(bench.CORPUS), tempfile.gettempdir()]))
    machine = results.machine()
    print(f"Machine: {results.describe(machine)}\n")
    failed = []
    for name in chosen:
        print(f"=== {name} ===", flush=True)
        started = time.monotonic()
        try:
            figures = importlib.import_module(f"bench.bench_{name}").run(OUT)
        except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
            print(f"FAILED: {type(exc).__name__}: {exc}")
            failed.append(name)
            continue
        saved = results.save(name, figures, machine)
        print(f"({time.monotonic() - started:.0f} s; figures in {saved})\n", flush=True)
    if results.update_page():
        print(f"Benchmark table in {results.PAGE.relative_to(results.REPO)} regenerated from {OUT}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
