"""Storage written the way the real stages write it: manifest, training outputs, a prepared-run dict.

The training outputs follow the contract in docs/CONTRACTS.md (summary.json written last, metrics JSON lines per
rank). The "model" directory holds `fixture_eval.json`: the result `fixture_evaluate` reports for that model, so
comparison logic runs through a real child process without TensorFlow. The dataset's tokenizer directory and every
model directory hold the same `tokenizer.json`, as the real ones do, so a promoted model counts as scorable on a
later run's shards.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from core.config import RunConfig
from core.config.core import EXPORT_FORMATS
from core.layout import StorageLayout, TrainOutput, run_key
from core.storage import join, write_bytes_atomic, write_json_atomic
from tasks.checked_run import OwnRun
from tasks.prepared_run import PreparedRun
from trainer.export import FORMAT_DIRS

FINGERPRINT = "3f2a9c01d4e5b6a7c8d9"
DAG_ID = "gpt_finetune"
HERE = Path(__file__).resolve().parent
TOKENIZER_JSON = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
                  "added_tokens": [{"id": 0, "content": "<|endoftext|>", "special": True}]}


def write_manifest(root: str, fingerprint: str = FINGERPRINT, tokenizer_fingerprint: str = "tok-77aa") -> str:
    url = StorageLayout(root).manifest(fingerprint)
    shard = {"name": "validation-00000-of-00001.tfrecord", "records": 2, "sequences": 40, "tokens": 2560,
             "bytes": 5200, "sha256": "0" * 64}
    write_json_atomic(url, {
        "format_version": 1, "fingerprint": fingerprint, "created_at": "2026-11-29T10:00:00+00:00",
        "dtype": "uint16", "block_size": 64, "sequences_per_record": 20,
        "tokenizer": {"spec": "bpe:2048", "fingerprint": tokenizer_fingerprint, "vocab_size": 2048,
                      "eos_token_id": 0, "path": "tokenizer"},
        "sources": [{"url": "data/sample/macbeth_gut.txt", "size": 100, "mtime": "2026-11-01T00:00:00+00:00"}],
        "settings": {"text_column": "text", "val_fraction": 0.05, "seed": 1234, "num_shards": 8},
        "splits": {"train": {"sequences": 800, "tokens": 51200, "shards": []},
                   "validation": {"sequences": 40, "tokens": 2560, "shards": [shard]}},
    })
    write_json_atomic(join(StorageLayout(root).dataset(fingerprint), "tokenizer", "tokenizer.json"), TOKENIZER_JSON)
    return url


def write_training_output(url: str, *, num_workers: int, global_batch_size: int = 16, steps: int = 40,
                          train_time_s: float, eval_loss: float, start_loss: float = 7.6, final_loss: float = 5.1,
                          cpu_count: int = 2, block_size: int = 64, complete: bool = True,
                          exports: dict[str, bool] | None = None) -> TrainOutput:
    """A finished training job: metrics of every rank, the model dir, its serving exports (`exports`: format ->
    parity passed; default all formats passed), then summary.json (when `complete`)."""
    output = TrainOutput(url)
    tokens_per_step = global_batch_size * block_size
    for rank in range(num_workers):
        lines = []
        for step in range(1, steps + 1):
            loss = final_loss + (start_loss - final_loss) * math.exp(-step / (steps / 4))
            lines.append(json.dumps({
                "step": step, "loss": round(loss, 4), "learning_rate": 1e-3,
                "tokens_per_s": tokens_per_step / (train_time_s / steps), "step_time_s": train_time_s / steps,
                "input_wait_s": 0.001, "tokens_seen": step * tokens_per_step, "time": 1_764_410_000.0 + step,
            }))
        write_bytes_atomic(output.metrics_file(rank), ("\n".join(lines) + "\n").encode())
    write_json_atomic(join(output.model, "fixture_eval.json"), {"eval_loss": eval_loss})
    write_json_atomic(join(output.model, "tokenizer.json"), TOKENIZER_JSON)
    write_bytes_atomic(join(output.model, "model.safetensors"), b"fixture safetensors")
    write_json_atomic(join(output.checkpoints, "checkpoint.json"), {"step": steps})
    write_exports(output, {name: True for name in EXPORT_FORMATS} if exports is None else exports)
    if complete:
        write_json_atomic(output.summary, {
            "num_workers": num_workers, "global_batch_size": global_batch_size, "steps": steps,
            "tokens_seen": steps * tokens_per_step, "wall_time_s": train_time_s + 6.0, "train_time_s": train_time_s,
            "tokens_per_s": (steps - 1) * tokens_per_step / train_time_s, "final_loss": final_loss, "mfu": None,
            "resumed_from_step": 0, "first_step_s": 2.5, "steps_timed": steps - 1,
            "hardware": {"host": "ci-runner", "cpu": "Fixture CPU @ 2.0GHz", "cpu_count": cpu_count,
                         "device": "CPU", "gpu": None},
            "versions": {"tensorflow": "2.21.0", "transformers": "5.0.0"},
            "config": {}, "started_at": "2026-11-29T10:01:00+00:00", "finished_at": "2026-11-29T10:02:00+00:00",
        })
    return output


def write_exports(output: TrainOutput, passed: dict[str, bool]) -> None:
    """exports/ as the trainer's chief leaves it (trainer/export.py): the model directory is the safetensors format,
    every other format a folder of its own, exports.json last."""
    formats = {}
    for name, ok in passed.items():
        files = [{"name": "model.safetensors", "bytes": len(b"fixture safetensors")}]
        if name != "safetensors":
            file = {"saved_model": "saved_model.pb"}[name]
            write_bytes_atomic(join(output.exports, name, file), b"fixture " + name.encode())
            files = [{"name": file, "bytes": len(b"fixture " + name.encode())}]
        diff = 2.5e-7 if ok else 3.2e-2
        formats[name] = {"passed": ok, "max_abs_diff": diff, "greedy_identical": ok, "tolerance": 1e-4,
                         "detail": f"max |logit diff| {diff:.2e} (limit 1e-04), greedy tokens {96 if ok else 90}/96 "
                                   "same", "files": files, "dir": FORMAT_DIRS[name], "seconds": 0.1}
    write_json_atomic(output.exports_record, {
        "format_version": 2, "tolerance": 1e-4, "prompts": {"count": 3, "tokens": 32, "source": "fixture"},
        "reference": {"dtype": "float32", "max_abs_logit": 9.5}, "formats": formats})


def prepare_run(root: str, run_id: str, manifest_url: str | None = None, **settings: Any) -> PreparedRun:
    """The prepare task's XCom for `settings` (the run config written as prepare does), without tokenizing, read
    back as a later task reads it (through JSON and `PreparedRun.from_xcom`).

    `manifest_url` names a real tokenized dataset; by default a manifest without shards is written.
    """
    from core.storage import read_bytes
    from tasks.prepare import PublishedManifest, lay_out_run

    manifest_url = manifest_url or write_manifest(root)
    cfg = RunConfig.from_params({"storage_root": root, **settings})
    data = read_bytes(manifest_url)  # as publish reads it, but unchecked: some tests name fingerprints of their own
    published = PublishedManifest(json.loads(data), manifest_url, hashlib.sha256(data).hexdigest())
    prepared = lay_out_run(cfg, published, run_key(DAG_ID, run_id), run_id=run_id)
    return PreparedRun.from_xcom(json.loads(json.dumps(prepared.to_xcom())))


def own_run(prepared: PreparedRun) -> OwnRun:
    """The DAG run a task of `prepared` runs in (Airflow's context hands it the real task): the one it was laid out
    for."""
    return OwnRun(DAG_ID, prepared.run_id)


def step_metrics(steps: range, step_time_s: float, tokens_per_step: int = 512) -> list[dict]:
    """Per-step metrics lines as the trainer writes them, at a constant step time."""
    return [{"step": s, "step_time_s": step_time_s, "tokens_per_s": tokens_per_step / step_time_s} for s in steps]


# An elastic train task's launch record (segments.json): 4 workers, then 2 after a lost host.
ELASTIC_RECORD = {"num_workers": 4, "grad_accum_steps": 1, "min_workers": 2, "launches": [
    {"try_number": 1, "from_step": 0, "num_workers": 4, "grad_accum_steps": 1, "reason": None, "hosts": []},
    # failed before its first checkpoint: contributed no step
    {"try_number": 2, "from_step": 20, "num_workers": 4, "grad_accum_steps": 1, "reason": None, "hosts": []},
    {"try_number": 3, "from_step": 20, "num_workers": 2, "grad_accum_steps": 2, "reason": "host h unreachable",
     "hosts": ["h0"]},
]}


def released_markdown(report_url: str) -> str:
    """report.md as the release task renders it (its one writer) from the parts beside it, for tests that stop before
    release; evaluate and promote write none."""
    from core.storage import exists, read_bytes
    from tasks.report.store import REPORT_MD, render_report_md

    assert not exists(join(report_url, REPORT_MD)), "only the release task writes report.md"
    render_report_md(report_url)
    return read_bytes(join(report_url, REPORT_MD)).decode()
