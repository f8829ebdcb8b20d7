"""Evaluation at held-out size (`make bench BENCH_ARGS=eval`): evaluate's cost on a corpus of a few hundred MB, made
from the shared Shakespeare plays, against training's start-up.

The corpus (CORPUS_MB, files of the plays in rotated order) is prepared by the real prepare stage in one task, with
the demo's tokenizer (bpe:2048, trained on the plays alone) and block (64); the demo's `tiny` GPT-2 trains
TRAIN_STEPS steps on 2 workers through the launcher (local backend). The trained model is then evaluated as the
evaluate task does (tasks/evaluate.run_evaluation: a group of the run's workers, each scoring its part of the sample,
combined exactly):

1. The default sample (`eval_tokens` 1,000,000) on 2 workers and on 1: wall time from launch to the combined result,
   each worker's scoring time, validation bytes read. Target: evaluate on 2 workers within training's start-up
   (launch to the end of the first, compiling step) plus BOUND_S.
2. The whole validation split (`eval_tokens` 0) on 1 worker, as evaluate ran before it was bounded, and on 2.
3. The sample's loss against the whole split's, in the sample's standard errors (expected within 3).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path

import bench

REPO = Path(__file__).resolve().parents[1]
CORPUS_MB = 256
FILE_MB = 32
TRAIN_STEPS = 40
BOUND_S = 60.0  # what evaluate may take beyond training's start-up
SETTINGS = {"model": "tiny", "block_size": 64, "batch_size_per_worker": 8, "max_steps": TRAIN_STEPS,
            "warmup_steps": 5, "learning_rate": 3e-3, "checkpoint_every_steps": TRAIN_STEPS}


def _corpus(directory: Path) -> Path:
    """CORPUS_MB of text in files of FILE_MB, each the plays in another rotated order, cut at a paragraph."""
    plays = [path.read_text(encoding="utf-8") for path in sorted(bench.CORPUS.glob("*.txt"))]
    directory.mkdir(parents=True)
    for index in range(CORPUS_MB // FILE_MB):
        text = "\n\n".join(plays[index % len(plays):] + plays[: index % len(plays)])
        data = ((text + "\n\n") * (FILE_MB * 2**20 // len(text.encode()) + 1)).encode("utf-8")[: FILE_MB * 2**20]
        (directory / f"part-{index:04d}.txt").write_bytes(data[: data.rindex(b"\n\n")] + b"\n")
    return directory


def _prepare(root: Path, dataset: str, tokenizer: str) -> tuple[str, float]:
    from core.config import RunConfig
    from tasks.dataset import stage

    started = time.perf_counter()
    cfg = RunConfig(**SETTINGS, num_workers=2, dataset=dataset, tokenizer=tokenizer, storage_root=str(root),
                    prepare_tasks=1)
    return stage.prepare_dataset(cfg, progress_interval_s=3600).manifest_url, time.perf_counter() - started


def _train(root: Path, manifest: str, tokenizer: str) -> dict:
    """2 workers through the launcher; the start-up is the launch to the end of the first (compiling) step."""
    from core.config import RunConfig
    from core.storage import read_json
    from launcher import GroupSpec, LocalBackend, WorkerGroup

    cfg = RunConfig(**SETTINGS, num_workers=2, tokenizer=tokenizer, storage_root=str(root))
    (root / "config.json").write_text(cfg.to_json())
    spec = GroupSpec(name="train", entrypoint="trainer.train", num_workers=2, run_key="bench-eval",
                     args=("--config", str(root / "config.json"), "--manifest", manifest, "--output",
                           str(root / "train")), startup_timeout_s=600, hang_timeout_s=600)
    first_step: list[float] = []

    def on_line(rank: int, line: str) -> None:  # the chief's progress line of step 1 ends the start-up
        if rank == 0 and line.startswith("step 1/") and not first_step:
            first_step.append(time.perf_counter())

    started = time.perf_counter()
    result = WorkerGroup(spec, LocalBackend(), root / "w-train", on_line=on_line).run()
    wall = time.perf_counter() - started
    if not result.succeeded:
        raise RuntimeError(result.error_message())
    summary = read_json(str(root / "train" / "summary.json"))
    startup = first_step[0] - started if first_step else wall - summary["train_time_s"]
    print(f"  train: 2 workers, {TRAIN_STEPS} steps, group wall {wall:.1f} s, start-up (launch to the end of the "
          f"first step) {startup:.1f} s, train time {summary['train_time_s']:.1f} s", flush=True)
    return {"wall_s": wall, "startup_s": startup, "train_time_s": summary["train_time_s"]}


def _evaluate(root: Path, manifest: str, workers: int, eval_tokens: int) -> dict:
    from core.config import RunConfig
    from launcher import LocalBackend
    from tasks.checked_run import Evaluation
    from tasks.evaluate import run_evaluation

    cfg = RunConfig(**SETTINGS, num_workers=workers, eval_tokens=eval_tokens, storage_root=str(root / "eval"))
    started = time.perf_counter()
    job = Evaluation(str(root / "train" / "model"), manifest, str(root / f"eval-{workers}-{eval_tokens}.json"),
                     f"{workers}-{eval_tokens}", cfg, "bench-eval")
    result = run_evaluation(job, make_backend=lambda name, settings: LocalBackend()).to_json()
    wall = time.perf_counter() - started
    sample = result["sample"]
    scoring = [worker["eval_time_s"] for worker in result["workers"]]
    print(f"  evaluate {'the whole split' if sample['whole_split'] else 'the sample'} ({sample['tokens']:,} of "
          f"{sample['split_tokens']:,} tokens) on {workers} worker(s): {wall:.1f} s wall, scoring "
          f"{' / '.join(f'{s:.1f}' for s in scoring)} s, text samples {result['sampling']['time_s']:.1f} s, "
          f"{sample['read_bytes'] / 2**20:.1f} MiB read; eval loss {result['eval_loss']:.4f} ± "
          f"{result['eval_loss_se'] or 0:.4f}", flush=True)
    return {"workers": workers, "eval_tokens": eval_tokens, "wall_s": wall, "scoring_s": scoring,
            "sampling_s": result["sampling"]["time_s"], "read_bytes": sample["read_bytes"],
            "tokens": sample["tokens"], "split_tokens": sample["split_tokens"], "eval_loss": result["eval_loss"],
            "eval_loss_se": result["eval_loss_se"]}


def run(out_dir: Path) -> dict:
    if not sorted(bench.CORPUS.glob("*.txt")):
        message = f"eval benchmark skipped: no .txt files in {bench.CORPUS} (the shared Shakespeare corpus)."
        print(message)
        return {"skipped": message}
    logging.getLogger("launcher").setLevel(logging.WARNING)
    logging.getLogger("gpt_finetune").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as scratch:
        root = Path(scratch)
        plays, _ = _prepare(root / "plays", str(bench.CORPUS / "*.txt"), "bpe:2048")
        tokenizer = str(Path(plays).parent / "tokenizer")
        corpus = _corpus(root / "corpus")
        manifest, prepare_s = _prepare(root, f"{corpus}/*.txt", tokenizer)
        with open(manifest) as handle:
            splits = json.load(handle)["splits"]
        print(f"  prepared {CORPUS_MB} MB: {splits['train']['tokens']:,} train / {splits['validation']['tokens']:,} "
              f"validation tokens in {prepare_s:.0f} s", flush=True)
        train = _train(root, manifest, tokenizer)
        runs = [_evaluate(root, manifest, workers, tokens) for workers, tokens in
                ((2, 1_000_000), (1, 1_000_000), (1, 0), (2, 0))]
    sample_2, sample_1, whole_1, whole_2 = runs
    beyond = sample_2["wall_s"] - train["startup_s"]
    deviation = (sample_2["eval_loss"] - whole_1["eval_loss"]) / (sample_2["eval_loss_se"] or float("inf"))
    validation_mb = whole_1["read_bytes"] / 2**20
    rows = [
        {"benchmark": f"eval: evaluate of a {CORPUS_MB} MB corpus's model ({sample_2['split_tokens']:,} validation "
                      f"tokens), default sample of {sample_2['tokens']:,} on 2 workers vs training's start-up "
                      "(launch to the first step's end)",
         "measured": f"{sample_2['wall_s']:.1f} s vs {train['startup_s']:.1f} s: {beyond:+.1f} s",
         "target": f"<= start-up + {BOUND_S:.0f} s"},
        {"benchmark": "eval: the default sample on 1 vs 2 workers, wall (scoring per worker)",
         "measured": f"{sample_1['wall_s']:.1f} s ({sample_1['scoring_s'][0]:.1f} s) vs {sample_2['wall_s']:.1f} s "
                     f"({' / '.join(f'{s:.1f}' for s in sample_2['scoring_s'])} s)",
         "target": "reported"},
        {"benchmark": "eval: the whole validation split (before: every run, on 1 worker) on 1 vs 2 workers, wall",
         "measured": f"{whole_1['wall_s']:.1f} s vs {whole_2['wall_s']:.1f} s "
                     f"({whole_1['wall_s'] / whole_2['wall_s']:.2f}x)",
         "target": "reported"},
        {"benchmark": "eval: validation bytes read, sample vs whole split",
         "measured": f"{sample_2['read_bytes'] / 2**20:.1f} MiB vs {validation_mb:.1f} MiB",
         "target": "<= eval_tokens + one batch"},
        {"benchmark": "eval: the sample's loss minus the whole split's, in the sample's standard errors",
         "measured": f"{deviation:+.2f} ({sample_2['eval_loss']:.4f} ± {sample_2['eval_loss_se']:.4f} vs "
                     f"{whole_1['eval_loss']:.4f})",
         "target": "within ±3"},
    ]
    for row in rows:
        print(f"  {row['benchmark']}: {row['measured']} (target {row['target']})")
    return {"corpus_mb": CORPUS_MB, "prepare_s": prepare_s, "train": train, "evaluations": runs, "rows": rows}
