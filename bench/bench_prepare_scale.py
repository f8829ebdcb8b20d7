"""The prepare stage at corpus scale (`make bench BENCH_ARGS=prepare-scale`): memory, bytes read, fan-out.

Corpora are built here from the shared Shakespeare plays: files of 24 MB (the plays concatenated, each file
starting at another play), 24, 96, 384 and 1536 MB of them. The tokenizer is a byte-level BPE of 8192 tokens
trained once on the plays, so that every figure below is the stage's tokenizing and publishing (BPE training on its
bounded sample is timed on its own). Every step runs in a fresh process, as an Airflow task does, without Airflow.

1. Peak RSS of the tokenizing process (the whole stage in one task, `prepare_tasks` 1) against corpus size: the
   slope (MB of RSS per MB of text) and intercept of a least-squares line, next to the 2.6 MB/MB the stage had
   when it held the corpus in memory. Targets: slope < 0.05, every run <= 512 MiB.
2. Tokens/s on 1 core against raw `encode_batch_fast` on the plays (bench/bench_prepare.py's measurement: fresh
   pinned processes, medians of their warm pairs). Target >= 0.9x.
3. Bytes the S3 server sent over the corpus's bytes, for a 48 MB `s3://` corpus through a counting proxy, two
   lanes of 16 MB units. Target ~1.0 (no whole-file copies).
4. Fan-out on this machine: 96 MB, `prepare_tasks` 1 on one core, against `prepare_tasks` 2 with each lane's
   process on its own core (two Airflow workers of one core each), plan and finish one process each; the time of
   each step shows the serial part. Target speedup >= 1.6x. For reference, `prepare_tasks` 1 with both cores (the
   tokenizer's own thread pool).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench

REPO = Path(__file__).resolve().parents[1]
CORPUS = bench.CORPUS
FILE_MB = 24
SIZES_MB = (24, 96, 384, 1536)
SLOPE_BEFORE = 2.6  # MB of RSS per MB of text, measured on the stage that loaded every document (issue 23)
RSS_TARGET_MB = 512
SLOPE_TARGET = 0.05
THROUGHPUT_TARGET = 0.9
SPEEDUP_TARGET = 1.6
S3_MB = 48
FAN_OUT_MB = 96
VOCAB = 8192


def run(out_dir: Path) -> dict:
    if not sorted(CORPUS.glob("*.txt")):
        message = f"prepare-scale benchmark skipped: no .txt files in {CORPUS} (the shared Shakespeare corpus)."
        print(message)
        return {"skipped": message}
    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="bench-prepare-scale-") as scratch:
        scratch = Path(scratch)
        tokenizer = _tokenizer(scratch)
        files = _corpus(scratch / "corpus", max(SIZES_MB) // FILE_MB)
        memory = [_memory_run(scratch, tokenizer, files[: size // FILE_MB], size) for size in SIZES_MB]
        slope, intercept = _line([m["text_mb"] for m in memory], [m["peak_rss_mb"] for m in memory])
        print(f"  peak RSS = {intercept:.0f} MB + {slope:.4f} x MB of text (before: {SLOPE_BEFORE} MB/MB)")
        throughput = _throughput(scratch, tokenizer, cores[0])
        s3 = _s3_bytes(scratch, tokenizer, files[: S3_MB // FILE_MB])
        fan_out = _fan_out(scratch, tokenizer, files[: FAN_OUT_MB // FILE_MB], cores)
        bpe = _bpe_run(scratch, files[: 384 // FILE_MB])
    peak = max(m["peak_rss_mb"] for m in memory)
    rows = [
        {"benchmark": "prepare scale: peak RSS of the tokenizing task, " + ", ".join(
            f"{m['text_mb']:.0f} MB -> {m['peak_rss_mb']:.0f} MB" for m in memory),
         "measured": f"slope {slope:.4f} MB/MB (before {SLOPE_BEFORE}), intercept {intercept:.0f} MB, "
                     f"peak {peak:.0f} MB",
         "target": f"< {SLOPE_TARGET} MB/MB, <= {RSS_TARGET_MB} MiB"},
        {"benchmark": "prepare scale: tokens/s on 1 core vs raw `encode_batch_fast`, 42 plays, BPE 8192 "
                      "(warm; by CPU time)",
         "measured": f"{throughput['ratio']:.2f}x ({throughput['cpu_ratio']:.2f}x)",
         "target": f">= {THROUGHPUT_TARGET}x"},
        {"benchmark": f"prepare scale: bytes read from S3 over corpus bytes ({S3_MB} MB, 2 lanes)",
         "measured": f"{s3['ratio']:.4f}", "target": "~1.0"},
        {"benchmark": f"prepare scale: {FAN_OUT_MB} MB, 2 mapped tasks (1 core each) vs 1 task on 1 core; steps of "
                      f"the 2-task run: plan {fan_out['two']['plan_s']:.1f} s, "
                      f"lanes {fan_out['two']['lanes_s']:.1f} s, finish (shards, manifest) "
                      f"{fan_out['two']['finish_s']:.1f} s",
         "measured": f"{fan_out['speedup']:.2f}x ({fan_out['one']['wall_s']:.0f} s -> {fan_out['two']['wall_s']:.0f} s;"
                     f" 1 task on {len(cores)} cores: {fan_out['one_all_cores']['wall_s']:.0f} s)",
         "target": f">= {SPEEDUP_TARGET}x"},
        {"benchmark": f"prepare scale: BPE {VOCAB} training on its default 256 MB sample of 384 MB",
         "measured": f"{bpe['train_s']:.0f} s, peak RSS {bpe['peak_rss_mb']:.0f} MB", "target": "reported"},
    ]
    return {"memory": memory, "slope_mb_per_mb": slope, "intercept_mb": intercept, "throughput": throughput,
            "s3": s3, "fan_out": fan_out, "bpe": bpe, "rows": rows}


# -- corpus and tokenizer ---------------------------------------------------------------------------------------


def _corpus(directory: Path, count: int) -> list[Path]:
    """`count` files of FILE_MB, each the plays in a rotated order, repeated and cut at a paragraph."""
    plays = [path.read_text(encoding="utf-8") for path in sorted(CORPUS.glob("*.txt"))]
    directory.mkdir(parents=True)
    files = []
    for index in range(count):
        rotated = plays[index % len(plays):] + plays[: index % len(plays)]
        text = "\n\n".join(rotated)
        blob = (text + "\n\n") * (FILE_MB * 2**20 // len(text.encode()) + 1)
        data = blob.encode("utf-8")[: FILE_MB * 2**20]
        data = data[: data.rindex(b"\n\n")] + b"\n"  # whole paragraphs: a file ends on a complete document
        path = directory / f"part-{index:04d}.txt"
        path.write_bytes(data)
        files.append(path)
    print(f"corpus: {count} files of {FILE_MB} MB built from {len(plays)} plays in {directory}")
    return files


def _tokenizer(scratch: Path) -> str:
    done = _child("prepare", {"dataset": str(CORPUS / "*.txt"), "tokenizer": f"bpe:{VOCAB}",
                              "storage_root": str(scratch / "tokenizer-root")})
    return str(Path(done["manifest_url"]).parent / "tokenizer")


# -- the measurements ---------------------------------------------------------------------------------------------


def _memory_run(scratch: Path, tokenizer: str, files: list[Path], size_mb: int) -> dict:
    root = scratch / f"rss-{size_mb}"
    link = _listing(scratch / f"rss-{size_mb}-files", files)
    done = _child("prepare", {"dataset": f"{link}/*.txt", "tokenizer": tokenizer, "storage_root": str(root),
                              "prepare_tasks": 1})
    shutil.rmtree(root, ignore_errors=True)
    text_mb = sum(f.stat().st_size for f in files) / 2**20
    print(f"  {text_mb:6.0f} MB of text: peak RSS {done['peak_rss_mb']:.0f} MB, {done['tokens'] / 1e6:.0f}M tokens "
          f"in {done['wall_s']:.0f} s ({done['tokens'] / done['wall_s'] / 1e6:.2f}M tokens/s)")
    return {"text_mb": text_mb, **done}


def _throughput(scratch: Path, tokenizer: str, core: int) -> dict:
    from bench.bench_prepare import CHILDREN, _summarize, _throughput_child

    figures = _summarize([_throughput_child(tokenizer, [core], scratch / f"throughput-{child}")
                          for child in range(CHILDREN)])
    print(f"  1 core: stage {figures['stage_tokens_per_s'] / 1e6:.2f}M tok/s vs raw "
          f"{figures['raw_tokens_per_s'] / 1e6:.2f}M tok/s: {figures['ratio']:.2f}x")
    return figures


def _s3_bytes(scratch: Path, tokenizer: str, files: list[Path]) -> dict:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    from tests.support.s3server import S3FaultProxy

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the S3 server's line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        proxy = S3FaultProxy(f"http://{host}:{port}").start()
        env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": proxy.endpoint}
        client = boto3.client("s3", endpoint_url=proxy.endpoint, aws_access_key_id="bench",
                              aws_secret_access_key="bench", region_name="us-east-1")
        client.create_bucket(Bucket="corpus")
        for path in files:
            client.upload_file(str(path), "corpus", f"text/{path.name}")
        source = sum(path.stat().st_size for path in files)
        before = proxy.got_bytes
        done = _child("prepare", {"dataset": "s3://corpus/text/*.txt", "tokenizer": tokenizer,
                                  "storage_root": str(scratch / "s3-root"), "prepare_tasks": 2,
                                  "prepare_unit_mb": 16}, env=env)
        ratio = (proxy.got_bytes - before) / source
        proxy.stop()
    finally:
        server.stop()
    print(f"  s3:// corpus of {source / 2**20:.0f} MB: {ratio:.4f}x its bytes read from S3 "
          f"(the units counted {done['fetched_bytes'] / source:.4f}x)")
    return {"source_bytes": source, "ratio": ratio, "units_fetched_ratio": done["fetched_bytes"] / source}


def _fan_out(scratch: Path, tokenizer: str, files: list[Path], cores: list[int]) -> dict:
    link = _listing(scratch / "fan-out-files", files)
    settings = {"dataset": f"{link}/*.txt", "tokenizer": tokenizer}
    one = _child("prepare", {**settings, "storage_root": str(scratch / "one"), "prepare_tasks": 1}, cores=cores[:1])
    one["wall_s"] = one["wall_s"] + one["start_s"]
    all_cores = _child("prepare", {**settings, "storage_root": str(scratch / "all"), "prepare_tasks": 1},
                       cores=cores)
    all_cores["wall_s"] = all_cores["wall_s"] + all_cores["start_s"]
    began = time.perf_counter()
    fanned = {**settings, "storage_root": str(scratch / "two"), "prepare_tasks": 2, "prepare_unit_mb": 16}
    planned = _child("plan", fanned, cores=cores[:1])
    plan_s = time.perf_counter() - began
    lanes_began = time.perf_counter()
    running = [_start_child("lane", {"plan": planned["plan"], "lane": lane}, cores=[cores[i % len(cores)]])
               for i, lane in enumerate(planned["lanes"])]
    for process in running:
        _finish_child(process)
    lanes_s = time.perf_counter() - lanes_began
    finish_began = time.perf_counter()
    finished = _child("finish", {"plan": planned["plan"], "settings": fanned}, cores=cores[:1])
    two = {"plan_s": plan_s, "lanes_s": lanes_s, "finish_s": time.perf_counter() - finish_began,
           "wall_s": time.perf_counter() - began, "lanes": len(planned["lanes"])}
    same = _shards(one["manifest_url"]) == _shards(finished["manifest_url"])
    speedup = one["wall_s"] / two["wall_s"]
    print(f"  {FAN_OUT_MB} MB: 1 task on 1 core {one['wall_s']:.1f} s; 2 tasks {two['wall_s']:.1f} s (plan "
          f"{plan_s:.1f} s, lanes {lanes_s:.1f} s, finish {two['finish_s']:.1f} s): {speedup:.2f}x; 1 task on "
          f"{len(cores)} cores {all_cores['wall_s']:.1f} s; shards identical: {same}")
    if not same:
        raise AssertionError("the 2-task shards differ from the 1-task shards")
    return {"one": one, "two": two, "one_all_cores": all_cores, "speedup": speedup, "identical": same}


def _bpe_run(scratch: Path, files: list[Path]) -> dict:
    link = _listing(scratch / "bpe-files", files)
    done = _child("train_bpe", {"dataset": f"{link}/*.txt", "tokenizer": f"bpe:{VOCAB}",
                                "storage_root": str(scratch / "bpe-root")})
    print(f"  BPE {VOCAB} on the default sample of {sum(f.stat().st_size for f in files) / 2**20:.0f} MB: "
          f"{done['train_s']:.0f} s, peak RSS {done['peak_rss_mb']:.0f} MB")
    return done


def _listing(directory: Path, files: list[Path]) -> Path:
    """A directory of symbolic links to `files`: a corpus that is a prefix of the built one, without copies."""
    directory.mkdir()
    for path in files:
        (directory / path.name).symlink_to(path)
    return directory


def _shards(manifest_url: str) -> list[str]:
    manifest = json.loads(Path(manifest_url).read_text())
    return [s["sha256"] for split in manifest["splits"].values() for s in split["shards"]]


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    slope = statistics.covariance(xs, ys) / statistics.variance(xs)
    return slope, statistics.fmean(ys) - slope * statistics.fmean(xs)


# -- child processes ------------------------------------------------------------------------------------------


def _start_child(step: str, options: dict, *, cores: list[int] | None = None,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    arguments = json.dumps({"step": step, "options": options, "cores": cores})
    return subprocess.Popen(
        [sys.executable, "-c", f"from bench.bench_prepare_scale import _step; _step({arguments!r})"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})})


def _finish_child(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=3600)
    if process.returncode != 0:
        raise RuntimeError(f"benchmark step failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _child(step: str, options: dict, **kwargs) -> dict:
    return _finish_child(_start_child(step, options, **kwargs))


def _step(arguments: str) -> None:
    """One step in this fresh process: pinned first (before any thread pool exists), then timed."""
    started = time.perf_counter()
    given = json.loads(arguments)
    if given["cores"]:
        os.sched_setaffinity(0, set(given["cores"]))
    from core.config import RunConfig
    from tasks.dataset import stage
    from tasks.dataset.records import Unit, WorkPlan
    from tasks.dataset.sources import resolve_sources
    from tasks.dataset.tokenizer import plan_tokenizer, train_bpe

    options = given["options"]
    start_s = time.perf_counter() - started
    began = time.perf_counter()
    if given["step"] == "prepare":
        cfg = RunConfig(num_workers=2, block_size=256, **options)
        result = stage.prepare_dataset(cfg, progress_interval_s=3600)
        answer = {"manifest_url": result.manifest_url, "tokens": result.tokenized_tokens, "timings": result.timings,
                  "fetched_bytes": result.source_bytes_read}
    elif given["step"] == "plan":
        planned = stage.plan_dataset(RunConfig(num_workers=2, block_size=256, **options), progress_interval_s=3600)
        lanes = [[unit.to_xcom() for unit in lane] for lane in planned.lanes]
        answer = {"plan": planned.work.to_xcom(), "lanes": lanes}
    elif given["step"] == "lane":
        lane = [Unit.from_xcom(unit) for unit in options["lane"]]
        answer = stage.tokenize_lane(WorkPlan.from_xcom(options["plan"]), lane, progress_interval_s=3600).to_xcom()
    elif given["step"] == "finish":
        cfg = RunConfig(num_workers=2, block_size=256, **options["settings"])
        answer = {"manifest_url": stage.finish_dataset(WorkPlan.from_xcom(options["plan"]), cfg).manifest_url}
    else:  # train_bpe
        cfg = RunConfig(num_workers=2, block_size=256, **options)
        train_bpe(resolve_sources(cfg.dataset, REPO), cfg, plan_tokenizer(cfg).sample, progress_interval_s=3600)
        answer = {"train_s": time.perf_counter() - began}
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({**answer, "wall_s": time.perf_counter() - began, "start_s": start_s,
                      "peak_rss_mb": peak_rss_mb}))
