"""GPU throughput check: GPT-2 124M, bf16 + XLA, one worker per GPU, tokens/s and MFU from the trainer's summary.

    uv sync --frozen --extra gpu && .venv/bin/python -m bench.gpu_check [--steps 60] [--batch 16] [--workers 1]

Runs the real prepare stage on the Shakespeare corpus (bpe:16384, block 1024) and the real `trainer.train`
(one process per GPU, TF_CONFIG on loopback when --workers > 1), then prints tokens/s, MFU (dense bf16 peak of
the GPU named by NVML, see trainer/metrics.py) and the compile time that the figures exclude. Target on an
H200: MFU >= 40%. Not part of `make bench` (needs a GPU); takes a few minutes, most of it XLA compilation.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tf_multiworker.launcher.local import PortAllocator

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "shakespeare"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="sequences of 1024 tokens per GPU per step")
    parser.add_argument("--workers", type=int, default=1, help="worker processes, one GPU each")
    parser.add_argument("--corpus", default=str(CORPUS / "*.txt"))
    args = parser.parse_args(argv)

    from tasks.tokenize import prepare_dataset
    from trainer.config import RunConfig

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        scratch = Path(scratch)
        cfg = RunConfig(
            dataset=args.corpus, storage_root=str(scratch / "storage"), tokenizer="bpe:16384", model="gpt2-124m",
            block_size=1024, batch_size_per_worker=args.batch, num_workers=args.workers, num_shards=4 * args.workers,
            max_steps=args.steps, warmup_steps=min(10, args.steps - 1), learning_rate=6e-4, mixed_precision="bf16",
            xla=True, use_gpu=True, checkpoint_every_steps=args.steps, collective_timeout_s=900,
        )
        dataset = prepare_dataset(cfg)
        config_path = scratch / "config.json"
        config_path.write_text(cfg.to_json())
        output = scratch / "train"
        addresses = [f"127.0.0.1:{p}" for p in PortAllocator().allocate(args.workers)] if args.workers > 1 else []
        procs = []
        for rank in range(args.workers):
            env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "1", "HF_HUB_OFFLINE": "1",
                   "CUDA_VISIBLE_DEVICES": str(rank)}
            env.pop("TF_CONFIG", None)
            if addresses:
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainer.train", "--config", str(config_path), "--manifest",
                 dataset.manifest_url, "--output", str(output)],
                cwd=REPO, env=env, stdout=None if rank == 0 else subprocess.DEVNULL,
            ))
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"training failed: exit codes {codes}")
            return 1
        summary = json.loads((output / "summary.json").read_text())

    mfu = summary["mfu"]
    print(f"\nGPU: {summary['hardware']['gpu']} x {args.workers}; GPT-2 124M, bf16 + XLA, block 1024, "
          f"batch {args.batch}/GPU")
    print(f"tokens/s {summary['tokens_per_s']:,.0f} over {summary['steps_timed']} steps "
          f"({summary['train_time_s']:.1f} s); compile + first step {summary['first_step_s']:.1f} s (excluded)")
    print(f"MFU {100 * mfu:.1f}% (target >= 40% on H200)" if mfu is not None else
          "MFU n/a: GPU not in trainer.metrics.PEAK_FLOPS_16BIT or NVML unavailable")
    print(f"input wait {100 * (summary['input_wait_fraction'] or 0):.2f}% of step time; final loss "
          f"{summary['final_loss']:.3f}")
    print(json.dumps({k: summary[k] for k in ("tokens_per_s", "mfu", "first_step_s", "train_time_s",
                                               "input_wait_fraction", "hardware")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
