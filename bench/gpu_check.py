"""GPU check: GPT-2 124M with bf16 + XLA, tokens/s, MFU and peak GPU memory; 2-GPU all-reduce bus bandwidth.

    uv sync --frozen --extra gpu && .venv/bin/python -m bench.gpu_check [--steps 60] [--batch 16] [--workers 1]
    .venv/bin/python -m bench.gpu_check --dry-run     # the same code on CPU with tiny shapes (a test runs it)

Runs the real prepare stage on the Shakespeare corpus (bpe:16384, block 1024) and the real `trainer.train` (one
process per GPU, TF_CONFIG on loopback when --workers > 1), then prints tokens/s, MFU (dense bf16 peak of the GPU
named by NVML, see trainer/metrics.py), the most GPU memory TensorFlow's allocator used during training
(`gpu_mem_peak_mb`: what training needs; the workers reserve the GPU as production's do, so NVML's in-use figure would
be the reservation) and the compile time the figures exclude. With two or
more GPUs it also times a 256 MiB NCCL all-reduce between two worker processes, one GPU each (bus bandwidth =
algorithm bandwidth x 2(N-1)/N, as nccl-tests report it). Target on an H200: MFU >= 40%.
Not part of `make bench` (needs a GPU); takes a few minutes, most of it XLA compilation. The figures go to
`bench-results/gpu_check.json` and the table in docs/benchmarks.md (bench/results.py); a dry run writes only where
--json says.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench
from bench import results
from launcher.local import PortAllocator

REPO = bench.REPO
MFU_TARGET = 0.40
REAL = {"tokenizer": "bpe:16384", "model": "gpt2-124m", "block_size": 1024, "mixed_precision": "bf16", "xla": True,
        "allreduce_bytes": 256 << 20, "allreduce_iterations": 20}
DRY_RUN = {"tokenizer": "bpe:512", "model": "tiny", "block_size": 64, "mixed_precision": "bf16", "xla": True,
           "allreduce_bytes": 1 << 20, "allreduce_iterations": 3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="sequences per GPU per step")
    parser.add_argument("--workers", type=int, default=1, help="training worker processes, one GPU each")
    parser.add_argument("--corpus", default=str(bench.CORPUS / "*.txt"))
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny model and shapes, the sample corpus: checks the script, measures nothing")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--allreduce-worker", nargs=3, metavar=("BYTES", "ITERATIONS", "OUT"),
                        help=argparse.SUPPRESS)  # internal: one rank of the all-reduce probe
    args = parser.parse_args(argv)
    if args.allreduce_worker:
        size, iterations, out = args.allreduce_worker
        return _allreduce_worker(int(size), int(iterations), out)

    gpus = results.machine()["gpus"]
    if args.dry_run:
        shapes, corpus = DRY_RUN, str(REPO / "data" / "sample" / "*.txt")
        args.steps, args.batch = min(args.steps, 4), min(args.batch, 2)
    elif len(gpus) < args.workers:
        print(f"gpu_check needs {args.workers} GPU(s) but nvidia-smi lists {len(gpus)} ({gpus or 'none'}): run it on a "
              "GPU machine (after `uv sync --frozen --extra gpu`), or pass --dry-run to check the script on CPU.")
        return 2
    else:
        shapes, corpus = REAL, args.corpus
    use_gpu = not args.dry_run

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        scratch = Path(scratch)
        summary, peak_mb = _train(args, shapes, corpus, use_gpu, scratch)
        allreduce = None
        if args.dry_run or len(gpus) >= 2:
            allreduce = _allreduce(shapes, use_gpu, scratch / "allreduce")

    figures = {
        "dry_run": args.dry_run, "gpu": summary["hardware"]["gpu"], "workers": args.workers, "model": shapes["model"],
        "batch_per_gpu": args.batch, "block_size": shapes["block_size"], "steps": args.steps,
        "tokens_per_s": summary["tokens_per_s"], "mfu": summary["mfu"], "peak_gpu_memory_mb": peak_mb,
        "first_step_s": summary["first_step_s"], "train_time_s": summary["train_time_s"],
        "input_wait_fraction": summary["input_wait_fraction"], "final_loss": summary["final_loss"],
        "allreduce": allreduce,
    }
    _report(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    if not args.dry_run:
        figures["rows"] = _rows(figures)
        results.save("gpu_check", figures, results.machine())
        results.update_page()
    return 0


def _train(args, shapes: dict, corpus: str, use_gpu: bool, scratch: Path) -> tuple[dict, float | None]:
    from core.config import RunConfig
    from tasks.dataset.stage import prepare_dataset

    cfg = RunConfig(
        dataset=corpus, storage_root=str(scratch / "storage"), tokenizer=shapes["tokenizer"], model=shapes["model"],
        block_size=shapes["block_size"], batch_size_per_worker=args.batch, num_workers=args.workers,
        num_shards=4 * args.workers, max_steps=args.steps, warmup_steps=min(10, args.steps - 1), learning_rate=6e-4,
        mixed_precision=shapes["mixed_precision"], xla=shapes["xla"], use_gpu=use_gpu,
        checkpoint_every_steps=args.steps, collective_timeout_s=900,
    )
    dataset = prepare_dataset(cfg)
    config_path = scratch / "config.json"
    config_path.write_text(cfg.to_json())
    output = scratch / "train"
    command = [sys.executable, "-m", "trainer.train", "--config", str(config_path), "--manifest",
               dataset.manifest_url, "--output", str(output)]
    codes = _run_workers(command, args.workers, use_gpu)
    if any(codes):
        raise SystemExit(f"training failed: exit codes {codes} (rank 0's log is above)")
    summary = json.loads((output / "summary.json").read_text())
    records = [json.loads(line) for line in (output / "metrics" / "rank-0.jsonl").read_text().splitlines() if line]
    memory = [r["gpu_mem_peak_mb"] for r in records if r.get("gpu_mem_peak_mb") is not None]
    return summary, max(memory) if memory else None


def _allreduce(shapes: dict, use_gpu: bool, out: Path) -> dict:
    """Two worker processes (one GPU each, or CPU for a dry run) time an all-reduce; the chief's figures."""
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "bench.gpu_check", "--allreduce-worker", str(shapes["allreduce_bytes"]),
               str(shapes["allreduce_iterations"]), str(out / "allreduce.json")]
    codes = _run_workers(command, 2, use_gpu)
    if any(codes):
        raise SystemExit(f"all-reduce probe failed: exit codes {codes} (rank 0's log is above)")
    return json.loads((out / "allreduce.json").read_text())


def _run_workers(command: list[str], workers: int, use_gpu: bool) -> list[int]:
    addresses = [f"127.0.0.1:{port}" for port in PortAllocator().allocate(workers)] if workers > 1 else []
    procs = []
    for rank in range(workers):
        env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "1", "HF_HUB_OFFLINE": "1",
               "CUDA_VISIBLE_DEVICES": str(rank) if use_gpu else ""}
        env.pop("TF_CONFIG", None)
        if addresses:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})
        procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=None if rank == 0 else subprocess.DEVNULL,
                                      stderr=None if rank == 0 else subprocess.DEVNULL, start_new_session=True))
    return [proc.wait(timeout=3600) for proc in procs]


def _allreduce_worker(size: int, iterations: int, out: str) -> int:
    """One rank: sum a float32 tensor of `size` bytes across the workers; the chief writes the timings."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    implementation = tf.distribute.experimental.CommunicationImplementation.NCCL if gpus else \
        tf.distribute.experimental.CommunicationImplementation.RING
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(implementation=implementation))
    # A plain variable on this worker's device (outside the strategy's scope): reading it inside the replica gives
    # the all-reduce a placed input without copying 256 MiB first, as tf.identity of a function argument would.
    payload = tf.Variable(tf.ones([size // 4], tf.float32), trainable=False)

    @tf.function
    def all_reduce():
        summed = strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", payload.read_value()))
        return strategy.experimental_local_results(summed)[0][:1]  # only 4 bytes come back to the host

    workers = strategy.num_replicas_in_sync
    first = float(all_reduce()[0])  # builds the communicator; every element is the number of workers
    if first != workers:
        raise RuntimeError(f"all-reduce of ones over {workers} workers gave {first}")
    seconds = []
    for _ in range(iterations):
        started = time.perf_counter()
        float(all_reduce()[0])
        seconds.append(time.perf_counter() - started)
    algbw = size / statistics.median(seconds)
    if strategy.cluster_resolver.task_id == 0:
        Path(out).write_text(json.dumps({
            "workers": workers, "bytes": size, "iterations": iterations, "implementation": implementation.name,
            "device": "GPU" if gpus else "CPU", "median_s": statistics.median(seconds), "algbw_gbps": algbw / 1e9,
            "busbw_gbps": algbw * 2 * (workers - 1) / workers / 1e9,
        }))
    return 0


def _report(figures: dict) -> None:
    where = "DRY RUN on CPU (tiny shapes: checks the script, the figures mean nothing)" if figures["dry_run"] else \
        f"GPU: {figures['gpu']} x {figures['workers']}"
    print(f"\n{where}; {figures['model']}, bf16 + XLA, block {figures['block_size']}, batch {figures['batch_per_gpu']}"
          f"/GPU, {figures['steps']} steps")
    print(f"tokens/s {figures['tokens_per_s']:,.0f} ({figures['train_time_s']:.1f} s timed); compile + first step "
          f"{figures['first_step_s']:.1f} s (excluded)")
    mfu = figures["mfu"]
    print(f"MFU {100 * mfu:.1f}% (target >= {100 * MFU_TARGET:.0f}% on H200)" if mfu is not None else
          "MFU n/a: no GPU, or it is not in trainer.metrics.PEAK_FLOPS_16BIT, or NVML is unavailable")
    peak = figures["peak_gpu_memory_mb"]
    print(f"peak GPU memory used by TensorFlow's allocator {peak / 1024:.1f} GiB" if peak is not None
          else "peak GPU memory n/a (no GPU)")
    print(f"input wait {100 * (figures['input_wait_fraction'] or 0):.2f}% of step time; final loss "
          f"{figures['final_loss']:.3f}")
    reduce = figures["allreduce"]
    if reduce is None:
        print("all-reduce: skipped (needs 2 GPUs)")
    else:
        print(f"all-reduce {reduce['bytes'] >> 20} MiB, {reduce['workers']} workers ({reduce['device']}, "
              f"{reduce['implementation']}), median of {reduce['iterations']}: algbw {reduce['algbw_gbps']:.2f} GB/s, "
              f"busbw {reduce['busbw_gbps']:.2f} GB/s")
    print(json.dumps(figures))


def _rows(figures: dict) -> list[dict]:
    mfu = f"{100 * figures['mfu']:.1f}%" if figures["mfu"] is not None else "MFU n/a"
    peak = f"{figures['peak_gpu_memory_mb'] / 1024:.1f} GiB" if figures["peak_gpu_memory_mb"] is not None else "n/a"
    reduce = figures["allreduce"]
    return [
        {"benchmark": f"gpu check: GPT-2 124M, bf16 + XLA, batch {figures['batch_per_gpu']} x "
                      f"{figures['block_size']} per GPU on {figures['gpu']}: tokens/s, MFU, peak memory",
         "measured": f"{figures['tokens_per_s']:,.0f} tokens/s, {mfu}, {peak}",
         "target": f"MFU >= {100 * MFU_TARGET:.0f}% on an H200"},
        {"benchmark": "gpu check: 256 MiB NCCL all-reduce, 2 workers x 1 GPU, bus bandwidth",
         "measured": f"{reduce['busbw_gbps']:.1f} GB/s" if reduce else "not run (fewer than 2 GPUs)",
         "target": "reported"},
    ]


if __name__ == "__main__":
    sys.exit(main())
