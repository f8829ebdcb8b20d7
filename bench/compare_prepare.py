"""Prepare the same corpus with this tree and with another checkout, and compare the datasets byte for byte.

    .venv/bin/python -m bench.compare_prepare --ref /tmp/prep-ref [--corpus GLOB] [--tokenizer SPEC ...]
        [--prepare-tasks N ...] [--unit-mb N] [--block-size N] [--max-document-mb N]

`--ref` is a source tree (e.g. `git archive <commit> | tar -x -C /tmp/prep-ref`). Both trees run with this
interpreter (the same package versions), each in a fresh process, into storage roots of their own, for every
tokenizer x prepare_tasks given. Every file of the two dataset directories must be the same bytes, except
`manifest.json`, which records when it was made: it is compared field by field, and the fields that differ are
named (only `created_at` may). Exits 1 on any other difference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import bench

REPO = bench.REPO
EXPECTED_TO_DIFFER = {"created_at"}  # the manifest's time of writing

# Run inside each tree: its own RunConfig (core.config now, trainer.config in trees before the layout move).
_RUNNER = """
import json, sys
try:
    from core.config import RunConfig
except ImportError:
    from trainer.config import RunConfig
from tasks.dataset.stage import prepare_dataset
settings = json.loads(sys.argv[1])
print(json.dumps({"manifest_url": prepare_dataset(RunConfig(**settings)).manifest_url}))
"""


def prepare_with(tree: Path, settings: dict) -> Path:
    """The dataset directory that `tree`'s prepare stage writes for `settings`."""
    completed = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(settings)], cwd=tree, check=False,
                               capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(tree), "TF_CPP_MIN_LOG_LEVEL": "3"})
    if completed.returncode != 0:
        raise SystemExit(f"prepare in {tree} failed ({settings}):\n{completed.stderr[-3000:]}")
    return Path(json.loads(completed.stdout.strip().splitlines()[-1])["manifest_url"]).parent


def compare(mine: Path, theirs: Path) -> tuple[list[str], set[str]]:
    """The differences between two dataset directories (none when they are the same but for `EXPECTED_TO_DIFFER`)
    and the manifest's fields that differ."""
    files = {p.relative_to(mine) for p in mine.rglob("*") if p.is_file()}
    other = {p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file()}
    problems = [f"only in this tree: {name}" for name in sorted(files - other)]
    problems += [f"only in the reference: {name}" for name in sorted(other - files)]
    fields: set[str] = set()
    for name in sorted(files & other):
        left, right = (mine / name).read_bytes(), (theirs / name).read_bytes()
        if name.name == "manifest.json":
            fields = _differing_fields(json.loads(left), json.loads(right))
            problems += [f"manifest.json field {field} differs" for field in sorted(fields - EXPECTED_TO_DIFFER)]
        elif left != right:
            problems.append(f"{name} differs ({len(left)} vs {len(right)} bytes)")
    return problems, fields


def _differing_fields(left: object, right: object, prefix: str = "") -> set[str]:
    if isinstance(left, dict) and isinstance(right, dict):
        found: set[str] = set()
        for key in left.keys() | right.keys():
            found |= _differing_fields(left.get(key), right.get(key), f"{prefix}{key}" if not prefix else
                                       f"{prefix}.{key}")
        return found
    return set() if left == right else {prefix or "(whole)"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", type=Path, required=True, help="the other source tree")
    parser.add_argument("--corpus", default=str(bench.CORPUS / "*.txt"),
                        help="the dataset (a glob of .txt, .jsonl or .parquet files)")
    parser.add_argument("--tokenizer", action="append", help="tokenizer specs (default: bpe:2048)")
    parser.add_argument("--prepare-tasks", type=int, action="append", help="lanes (default: 1 and 2)")
    parser.add_argument("--unit-mb", type=int, default=1, help="prepare_unit_mb with more than one lane")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--max-document-mb", type=int, help="where long documents are cut (default: the setting's)")
    args = parser.parse_args()
    failures = 0
    with tempfile.TemporaryDirectory(prefix="compare-prepare-") as scratch:
        runs = itertools.product(args.tokenizer or ["bpe:2048"], args.prepare_tasks or [1, 2])
        for run, (tokenizer, tasks) in enumerate(runs):
            settings = {"dataset": args.corpus, "tokenizer": tokenizer, "block_size": args.block_size,
                        "model": "gpt2-124m", "num_workers": 2, "prepare_tasks": tasks,
                        "prepare_unit_mb": args.unit_mb if tasks > 1 else 0}
            if args.max_document_mb:
                settings["max_document_mb"] = args.max_document_mb
            mine = prepare_with(REPO, {**settings, "storage_root": f"{scratch}/mine-{run}"})
            theirs = prepare_with(args.ref, {**settings, "storage_root": f"{scratch}/ref-{run}"})
            problems, fields = compare(mine, theirs)
            count = sum(1 for p in mine.rglob("*") if p.is_file())
            print(f"tokenizer {tokenizer}, prepare_tasks {tasks}: {count} files; manifest fields that differ: "
                  f"{sorted(fields) or 'none'}; " + ("; ".join(problems) or "every other byte identical"))
            failures += bool(problems)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
