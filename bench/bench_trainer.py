"""Trainer input pipeline and data-parallel throughput on CPU, on the 42 Shakespeare plays.

1. The real prepare stage tokenizes the corpus (bpe:2048, block 128, 8 shards) into a fresh storage root.
2. `trainer.train` as real processes, one after the other: 1 worker x batch 8 x 2 accumulation steps, then
   2 workers (TF_CONFIG on loopback) x batch 8: the same global batch of 16 sequences, tiny preset, 60 steps.
   From each run's summary.json: tokens/s (compile and first step excluded) and the share of step time spent
   waiting for input (target < 2%); the two loss curves are compared as a by-product.
3. tf.data read rate: `trainer.data.make_dataset` alone over one worker's shards (shuffle + repeat, as in
   training), in this process, against that worker's training consumption (target >= 5x).
The tiny model is the hard case for the input pipeline: its steps are short, so any input stall shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tf_multiworker.launcher.local import PortAllocator

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "shakespeare"
STEPS = 60
READ_SECONDS = 5.0
SETTINGS = {
    "tokenizer": "bpe:2048", "block_size": 128, "num_shards": 8, "model": "tiny", "batch_size_per_worker": 8,
    "max_steps": STEPS, "warmup_steps": 5, "learning_rate": 1e-3, "checkpoint_every_steps": STEPS,
}


def _train(config: dict, manifest_url: str, out: Path) -> tuple[dict, list[dict]]:
    """One training job as worker processes; returns the chief's summary and metrics lines."""
    out.mkdir(parents=True)
    config_path = out / "config.json"
    config_path.write_text(json.dumps(config))
    workers = config["num_workers"]
    addresses = [f"127.0.0.1:{p}" for p in PortAllocator().allocate(workers)] if workers > 1 else []
    procs = []
    for rank in range(workers):
        env = {**os.environ, "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"}
        env.pop("TF_CONFIG", None)
        if addresses:
            env["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})
        log = (out / f"rank-{rank}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainer.train", "--config", str(config_path), "--manifest", manifest_url,
             "--output", str(out / "output")],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        ))
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        tail = (out / "rank-0.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"training with {workers} worker(s) failed with exit codes {codes}:\n{tail}")
    summary = json.loads((out / "output" / "summary.json").read_text())
    lines = (out / "output" / "metrics" / "rank-0.jsonl").read_text().splitlines()
    return summary, [json.loads(line) for line in lines]


def _read_rate(manifest_url: str, block_size: int, batch_size: int, seed: int) -> float:
    """Tokens/s that make_dataset delivers from worker 0's shards (of 2), after the shuffle buffer filled."""
    from trainer.data import load_manifest, make_dataset, stage_shards, worker_shards

    manifest = load_manifest(manifest_url)
    with tempfile.TemporaryDirectory(prefix="bench-read-") as local:
        files = stage_shards(manifest_url, worker_shards(manifest, "train", 0, 2), local)
        dataset = make_dataset(files, block_size=block_size, dtype=manifest["dtype"], batch_size=batch_size,
                               shuffle=True, seed=seed, repeat=True)
        iterator = iter(dataset)
        next(iterator)
        batches, started = 0, time.perf_counter()
        while time.perf_counter() - started < READ_SECONDS:
            next(iterator)
            batches += 1
        return batches * batch_size * block_size / (time.perf_counter() - started)


def run(out_dir: Path) -> dict:
    if not sorted(CORPUS.glob("*.txt")):
        message = f"trainer benchmark skipped: no .txt files in {CORPUS} (the shared Shakespeare corpus)."
        print(message)
        return {"skipped": message}
    from tasks.tokenize import prepare_dataset
    from trainer.config import RunConfig
    from trainer.metrics import cpu_model

    hardware = f"{os.cpu_count()} x {cpu_model()} (CPU only)"
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as scratch:
        scratch = Path(scratch)
        base = RunConfig(dataset=str(CORPUS / "*.txt"), storage_root=str(scratch / "storage"), num_workers=2,
                         **SETTINGS)
        dataset = prepare_dataset(base)
        print(f"dataset: {dataset.train_sequences} train sequences of {base.block_size} tokens, "
              f"{base.effective_num_shards} shards ({dataset.elapsed_s:.1f} s to prepare)")
        runs = {}
        for workers in (1, 2):
            cfg = base.replace(num_workers=workers, grad_accum_steps=2 // workers)
            summary, records = _train(cfg.to_dict(), dataset.manifest_url, scratch / f"w{workers}")
            waits = sorted(r["input_wait_s"] for r in records[1:])  # the first step fills the shuffle buffer
            steps = sorted(r["step_time_s"] for r in records[1:])
            runs[workers] = {"summary": summary, "losses": [r["loss"] for r in records],
                             "median_input_wait_s": waits[len(waits) // 2], "max_input_wait_s": waits[-1],
                             "median_step_s": steps[len(steps) // 2]}
            print(f"{workers} worker(s) x batch {cfg.batch_size_per_worker} x {cfg.grad_accum_steps} micro-steps: "
                  f"{summary['tokens_per_s']:,.0f} tokens/s over {summary['steps_timed']} timed steps, input wait "
                  f"{100 * summary['input_wait_fraction']:.2f}% of step time (target < 2%; per step median "
                  f"{1e3 * waits[len(waits) // 2]:.2f} ms, max {1e3 * waits[-1]:.1f} ms, median step "
                  f"{1e3 * steps[len(steps) // 2]:.0f} ms), first step {summary['first_step_s']:.1f} s (not counted)",
                  flush=True)
        read_rate = _read_rate(dataset.manifest_url, base.block_size, base.batch_size_per_worker, base.seed)

    one, two = runs[1]["summary"], runs[2]["summary"]
    per_worker_consumption = two["tokens_per_s"] / 2
    loss_gap = max(abs(a - b) for a, b in zip(runs[1]["losses"], runs[2]["losses"], strict=True))
    figures = {
        "hardware": hardware,
        "tokens_per_s_1_worker": one["tokens_per_s"],
        "tokens_per_s_2_workers": two["tokens_per_s"],
        "speedup_2_vs_1": two["tokens_per_s"] / one["tokens_per_s"],
        "input_wait_fraction_1_worker": one["input_wait_fraction"],
        "input_wait_fraction_2_workers": two["input_wait_fraction"],
        "median_input_wait_s": {w: runs[w]["median_input_wait_s"] for w in runs},
        "max_input_wait_s": {w: runs[w]["max_input_wait_s"] for w in runs},
        "median_step_s": {w: runs[w]["median_step_s"] for w in runs},
        "read_tokens_per_s_per_worker": read_rate,
        "read_vs_consumption_1_worker": read_rate / one["tokens_per_s"],
        "read_vs_consumption_2_workers": read_rate / per_worker_consumption,
        "max_loss_gap_1_vs_2_workers": loss_gap,
        "steps": STEPS,
        "settings": SETTINGS,
    }
    print(f"hardware: {hardware}")
    print(f"1 vs 2 workers (same global batch 16 x 128 tokens): {one['tokens_per_s']:,.0f} vs "
          f"{two['tokens_per_s']:,.0f} tokens/s, speedup {figures['speedup_2_vs_1']:.2f}x "
          "(2 workers share the same 2 cores here, so this measures overhead, not scaling)")
    print(f"tf.data read rate {read_rate:,.0f} tokens/s per worker vs training consumption "
          f"{one['tokens_per_s']:,.0f} (1 worker) / {per_worker_consumption:,.0f} (each of 2 workers): "
          f"{figures['read_vs_consumption_1_worker']:.1f}x / {figures['read_vs_consumption_2_workers']:.1f}x "
          "(target >= 5x)")
    print(f"loss curves of 1 worker x 2 micro-steps and 2 workers: max difference {loss_gap:.2e} over {STEPS} steps")
    return figures
