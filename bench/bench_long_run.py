"""A long run of the real trainer: threads and resident memory of each worker at the start and end.

2 workers of `trainer.train` through the launcher (tiny preset, one 8-token sequence per worker per step, so steps
are as short as they get), STEPS steps with a checkpoint every 500. Each worker's thread count (/proc/<pid>/task)
and RSS are sampled every 0.2 s with the step it had reached. Start = the first sample after step 100 (the step is
traced and the input pipeline full by then); end = the last sample at the final step. Target: threads flat (a
per-collective timeout in TF 2.21 adds 2 threads per step until pthread_create fails, tensorflow#62466).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

STEPS = 3000
START_STEP = 100


def run(out_dir: Path) -> dict:
    from core.storage import read_json
    from tests.trainer.long_run import TrainGroup, write_tiny_dataset

    with tempfile.TemporaryDirectory(prefix="bench-long-run-") as scratch:
        scratch = Path(scratch)
        manifest = write_tiny_dataset(scratch / "dataset")
        job = TrainGroup(scratch / "run", manifest, max_steps=STEPS, checkpoint_every_steps=500)
        started = time.monotonic()
        job.start()
        result = job.wait(3600)
        wall_s = time.monotonic() - started
        if not result.succeeded:
            raise RuntimeError(result.error_message())
        summary = read_json(f"{job.output}/summary.json")
        workers = {}
        for rank in range(2):
            samples = job.rank_samples(rank)
            start = next(s for s in samples if s.step >= START_STEP)
            end = [s for s in samples if s.step == STEPS][-1]
            peak = max((s for s in samples if s.step >= start.step), key=lambda s: s.threads)
            workers[rank] = {
                "start_step": start.step, "end_step": end.step, "threads_start": start.threads,
                "threads_end": end.threads, "threads_peak": peak.threads,
                "rss_mib_start": round(start.rss_bytes / 2**20, 1), "rss_mib_end": round(end.rss_bytes / 2**20, 1),
            }
            print(f"rank {rank}: threads {start.threads} at step {start.step} -> {end.threads} at step {end.step} "
                  f"(peak {peak.threads}); RSS {workers[rank]['rss_mib_start']:.0f} -> "
                  f"{workers[rank]['rss_mib_end']:.0f} MiB", flush=True)
    ms_per_step = summary["train_time_s"] / summary["steps_timed"] * 1e3
    growth = ", ".join(f"rank {rank} {w['threads_end'] - w['threads_start']:+d}" for rank, w in workers.items())
    print(f"2 workers x {STEPS} steps in {wall_s:.0f} s wall ({ms_per_step:.1f} ms per step); thread growth from step "
          f"{START_STEP} to the end: {growth} (target: flat, within +50)")
    threads = " and ".join(f"{w['threads_start']} -> {w['threads_end']}" for w in workers.values())
    peaks = ", ".join(str(w["threads_peak"]) for w in workers.values())
    rss = " and ".join(f"{w['rss_mib_start']:.0f} -> {w['rss_mib_end']:.0f}" for w in workers.values())
    start = min(w["start_step"] for w in workers.values())
    row = {"benchmark": f"long run: 2 workers x {STEPS:,} steps (tiny), threads and RSS per worker at step {start} -> "
                        f"{STEPS:,}", "measured": f"threads {threads} (peaks {peaks}); RSS {rss} MiB",
           "target": "threads flat (within +50)"}
    return {"num_workers": 2, "steps": STEPS, "wall_time_s": wall_s,
            "ms_per_step": ms_per_step, "workers": workers, "rows": [row]}
