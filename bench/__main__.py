"""`make bench`: every benchmark of the project, each printing ratios measured side by side in one run.

Usage: python -m bench [NAME ...]   (names: the bench_<name>.py modules; default all)
Results: bench-results/<name>.json plus the printed lines.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import platform
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "bench-results"


def hardware() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                   platform.processor() or "unknown CPU")
    return f"{os.cpu_count()} x {cpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def main(names: list[str]) -> int:
    here = [str(Path(__file__).parent)]  # run as __main__, the module has no package __path__
    available = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(here) if m.name.startswith("bench_"))
    chosen = names or available
    unknown = sorted(set(chosen) - set(available))
    if unknown:
        print(f"Unknown benchmark(s) {unknown}; available: {available}")
        return 2
    OUT.mkdir(exist_ok=True)
    # The benchmarks read the shared corpus and write to temporary directories: allow both (trainer/config.py).
    repo = OUT.parent
    os.environ.setdefault("GPT_FINETUNE_DATA_ROOTS", os.pathsep.join(
        [str(repo / "data"), str(repo / "storage"), str(repo.parent / "shared" / "data"), tempfile.gettempdir()]))
    print(f"Hardware: {hardware()}\n")
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
        (OUT / f"{name}.json").write_text(json.dumps({"hardware": hardware(), **figures}, indent=2, default=str))
        print(f"({time.monotonic() - started:.0f} s)\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
