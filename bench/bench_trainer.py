"""Trainer input pipeline and data-parallel throughput on CPU, on the 42 Shakespeare plays.

1. The real prepare stage tokenizes the corpus (bpe:2048, block 128, 8 shards) into a fresh storage root.
2. `trainer.train` as real processes, one after the other: 1 worker x batch 8 x 2 accumulation steps, then
   2 workers (TF_CONFIG on loopback) x batch 8: the same global batch of 16 sequences, tiny preset, 60 steps.
   From each run's summary.json: tokens/s (compile and first step excluded) and the share of step time spent
   waiting for input (target < 2%); the two loss curves are compared as a by-product.
3. tf.data read rate: `trainer.data.make_dataset` alone over one worker's shards (shuffle + repeat, as in
   training), in this process, against that worker's training consumption (target >= 5x).
4. The trainer against the simplest thing a user would write: a plain `tf.function` loop of the same model and loss,
   the same AdamW, schedule and gradient clipping, on the same token stream (`make_dataset` over the same
   shards, same seed) and batch, 1 worker, CPU, for the tiny preset and GPT-2 124M (the mid-size preset; the largest
   there is). Same update on the same data: the mean losses over the run are printed side by side. Both run as fresh
   processes, alternating which goes first; both exclude their first step (tracing) and sync every step (the trainer
   and the loop read the loss). Ratio: trainer tokens/s / loop tokens/s per pair,
   median (target >= 0.95x); also by median step-to-step time, which a burst of other load moves less. The trainer's
   time is split from its metrics: waiting for input, inside the step, and between steps (metrics, TensorBoard,
   progress; the only checkpoint comes after the last timed step).
The tiny model is the hard case for the input pipeline and per-step overheads: its steps are short.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench
from launcher.local import PortAllocator

REPO = Path(__file__).resolve().parents[1]
CORPUS = bench.CORPUS
STEPS = 60
READ_SECONDS = 5.0
FLOOR = {"tiny": {"max_steps": 60, "batch_size_per_worker": 8, "pairs": 3},  # presets x (steps, batch, pairs)
         "gpt2-124m": {"max_steps": 8, "batch_size_per_worker": 4, "pairs": 2}}
FLOOR_TARGET = 0.95
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
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"}
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


def loop_floor(config_path: str, manifest_url: str, out_path: str) -> None:
    """The floor, in this (fresh) process: the plainest loop a user would write on what the trainer would train (a
    `tf.function` step of the same model, loss, clip and AdamW over the same stream, no strategy, no metrics);
    writes its timings."""
    import tensorflow as tf

    from bench.bench_model import plain_step
    from core import storage
    from core.config import RunConfig
    from trainer.data import load_manifest, make_dataset, shard_cache_dir, stage_shards, worker_shards
    from trainer.model import Vocabulary, build_model
    from trainer.recipe import set_random_seed

    cfg = RunConfig.from_saved(storage.read_json(config_path))
    tf.config.set_visible_devices([], "GPU")
    set_random_seed(cfg.seed)
    manifest = load_manifest(manifest_url)
    # 1 worker x 1 micro-step: the trainer's only slot reads every training shard, in this seeded order.
    files = stage_shards(manifest_url, worker_shards(manifest, "train", 0, 1), shard_cache_dir(manifest["fingerprint"]))
    tokens = make_dataset(files, block_size=cfg.block_size, dtype=manifest["dtype"],
                          batch_size=cfg.batch_size_per_worker, shuffle=True, seed=cfg.seed, repeat=True)
    with tempfile.TemporaryDirectory(prefix="loop-floor-") as work_dir:
        model = build_model(cfg.model, Vocabulary.of(manifest["tokenizer"]), block_size=cfg.block_size,
                            work_dir=work_dir, seed=cfg.seed)
    step = plain_step(model, cfg)

    ends, losses = [time.perf_counter()], []
    for batch in tokens.take(cfg.max_steps).prefetch(tf.data.AUTOTUNE):
        losses.append(float(step(batch)))  # reading the loss waits for the step, as the trainer does
        ends.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(ends)]
    timed_s = ends[-1] - ends[1]  # the first step (tracing) excluded, as in the trainer
    tokens_per_step = cfg.batch_size_per_worker * cfg.block_size
    Path(out_path).write_text(json.dumps({
        "tokens_per_s": (cfg.max_steps - 1) * tokens_per_step / timed_s, "first_step_s": steps[0],
        "median_step_s": statistics.median(steps[1:]), "median_interval_s": statistics.median(steps[1:]),
        "mean_loss": statistics.mean(losses),
    }))


def _plain_loop(config: dict, manifest_url: str, out: Path) -> dict:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HF_HUB_OFFLINE": "1"}
    env.pop("TF_CONFIG", None)
    with (out / "loop.log").open("wb") as log:
        code = subprocess.run(
            [sys.executable, "-m", "bench.bench_trainer", "--loop", str(out / "config.json"), manifest_url,
             str(out / "loop.json")], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False,
        ).returncode
    if code:
        raise RuntimeError(f"plain loop floor failed with exit code {code}:\n"
                           f"{(out / 'loop.log').read_text(errors='replace')[-3000:]}")
    return json.loads((out / "loop.json").read_text())


def _trainer_breakdown(summary: dict, records: list[dict]) -> dict:
    """Where the trainer's timed steps went (the first step is not timed)."""
    timed = records[1:]
    input_s = sum(r["input_wait_s"] for r in timed)
    step_s = sum(r["step_time_s"] for r in timed) - input_s
    train_s = summary["train_time_s"]
    intervals = [b["time"] - a["time"] for a, b in itertools.pairwise(records)]  # step end to step end
    return {"input_s": input_s, "step_s": step_s, "between_steps_s": train_s - input_s - step_s, "train_s": train_s,
            "median_step_s": statistics.median(r["step_time_s"] for r in timed),
            "median_interval_s": statistics.median(intervals)}


def _trainer_side(cfg, manifest_url: str, out: Path) -> dict:
    summary, records = _train(cfg.to_dict(), manifest_url, out)
    return {"tokens_per_s": summary["tokens_per_s"], "mean_loss": statistics.mean(r["loss"] for r in records),
            **_trainer_breakdown(summary, records)}


def _floor(base, manifest_url: str, scratch: Path) -> dict:
    """Trainer vs a plain loop, per preset: paired fresh processes, alternating order, median ratio."""
    results = {}
    for preset, plan in FLOOR.items():
        cfg = base.replace(model=preset, num_workers=1, grad_accum_steps=1, max_steps=plan["max_steps"],
                           batch_size_per_worker=plan["batch_size_per_worker"],
                           warmup_steps=min(5, plan["max_steps"] - 1), checkpoint_every_steps=plan["max_steps"])
        pairs = []
        for pair in range(plan["pairs"]):
            where = scratch / f"floor-{preset}-{pair}"

            measured = {}
            for side in ("loop", "trainer") if pair % 2 else ("trainer", "loop"):
                measured[side] = (_trainer_side(cfg, manifest_url, where / side) if side == "trainer"
                                  else _plain_loop(cfg.to_dict(), manifest_url, where / side))
            trainer, loop = measured["trainer"], measured["loop"]
            pairs.append({"trainer": trainer, "loop": loop, "ratio": trainer["tokens_per_s"] / loop["tokens_per_s"],
                          "interval_ratio": loop["median_interval_s"] / trainer["median_interval_s"]})
            print(f"  {preset} pair {pair + 1}/{plan['pairs']}: trainer {trainer['tokens_per_s']:,.0f} tokens/s "
                  f"(median step {1e3 * trainer['median_step_s']:.1f} ms, mean loss {trainer['mean_loss']:.4f}), "
                  f"plain loop {loop['tokens_per_s']:,.0f} tokens/s (median step {1e3 * loop['median_step_s']:.1f} ms, "
                  f"mean loss {loop['mean_loss']:.4f}): {pairs[-1]['ratio']:.3f}x", flush=True)
        ratio = statistics.median(p["ratio"] for p in pairs)
        interval_ratio = statistics.median(p["interval_ratio"] for p in pairs)
        split = {key: statistics.median(p["trainer"][key] / p["trainer"]["train_s"] for p in pairs)
                 for key in ("input_s", "step_s", "between_steps_s")}
        results[preset] = {"ratio": ratio, "interval_ratio": interval_ratio, "pairs": pairs, "time_shares": split,
                           "batch": cfg.batch_size_per_worker, "block_size": cfg.block_size, "steps": cfg.max_steps}
        print(f"{preset} (batch {cfg.batch_size_per_worker} x {cfg.block_size}, {cfg.max_steps} steps): trainer / "
              f"plain loop = {ratio:.3f}x by tokens/s (median of {len(pairs)} pairs; target >= {FLOOR_TARGET}: "
              f"{'met' if ratio >= FLOOR_TARGET else 'NOT met'}), {interval_ratio:.3f}x by median step to step "
              f"time (steadier where other work shares the cores); trainer time: input {100 * split['input_s']:.1f}%, "
              f"step {100 * split['step_s']:.1f}%, between steps (metrics, TensorBoard, progress) "
              f"{100 * split['between_steps_s']:.1f}%", flush=True)
    return results


def run(out_dir: Path) -> dict:
    if not sorted(CORPUS.glob("*.txt")):
        message = f"trainer benchmark skipped: no .txt files in {CORPUS} (the shared Shakespeare corpus)."
        print(message)
        return {"skipped": message}
    from core.config import RunConfig
    from tasks.dataset.stage import prepare_dataset
    from trainer.host_info import cpu_model

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
        print("trainer vs a plain loop, 1 worker:", flush=True)
        floor = _floor(base, dataset.manifest_url, scratch)

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
        "floor": floor,
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
    figures["rows"] = [
        {"benchmark": "trainer: input wait share of step time, 1 and 2 workers",
         "measured": f"{100 * one['input_wait_fraction']:.2f}% / {100 * two['input_wait_fraction']:.2f}%",
         "target": "< 2%"},
        {"benchmark": "trainer: tf.data read rate vs training consumption, 1 and 2 workers",
         "measured": f"{figures['read_vs_consumption_1_worker']:.0f}x / "
                     f"{figures['read_vs_consumption_2_workers']:.0f}x",
         "target": ">= 5x"},
        {"benchmark": "trainer: 2 workers vs 1 worker x 2 accumulation, tokens/s (2 cores: overhead only)",
         "measured": f"{two['tokens_per_s']:,.0f} vs {one['tokens_per_s']:,.0f} = {figures['speedup_2_vs_1']:.2f}x",
         "target": "reported"},
        {"benchmark": f"trainer: max loss difference, 2 workers vs 1 worker x 2 accumulation, {STEPS} steps",
         "measured": f"{loss_gap:.2e}", "target": "exact up to rounding"},
    ] + [
        {"benchmark": f"trainer: vs a plain tf.function loop, same model, stream and batch, 1 worker, {preset} "
                      f"(batch {entry['batch']} x {entry['block_size']}); trainer time: input / step / between steps",
         "measured": f"{entry['ratio']:.2f}x (median of {len(entry['pairs'])} pairs; by median step "
                     f"{entry['interval_ratio']:.2f}x); "
                     f"{100 * entry['time_shares']['input_s']:.1f}% / {100 * entry['time_shares']['step_s']:.1f}% / "
                     f"{100 * entry['time_shares']['between_steps_s']:.1f}%",
         "target": f">= {FLOOR_TARGET}x"}
        for preset, entry in floor.items()
    ]
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the plain loop floor of this benchmark, in its own process")
    parser.add_argument("--loop", nargs=3, metavar=("CONFIG", "MANIFEST", "OUT"), required=True)
    loop_floor(*parser.parse_args().loop)
