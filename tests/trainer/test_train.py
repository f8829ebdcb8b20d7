"""trainer.train as real worker processes on loopback: 1 and 2 workers, data-parallel exactness, kill + resume.

Three training jobs share TF start-up by running side by side (tiny model, 40 steps of 8 sequences):
- `single`: 1 worker x batch 4 x 2 accumulation steps;
- `pair`:   2 workers (TF_CONFIG on free loopback ports) x batch 4 x 1 step: the same global batch;
- `resumed`: the `pair` job, whose rank 1 is killed after its first checkpoint, then restarted;
- `xla`: the `pair` job with `xla: true` (gradients and update compiled), for its first XLA_STEPS steps.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import ConfigError
from core.protocol import EXIT_PERMANENT
from launcher.local import PortAllocator
from tests.trainer.shards import write_dataset
from trainer.data import DataError
from trainer.job import plan_job

REPO = Path(__file__).resolve().parents[2]
STEPS = 40
CHECKPOINT_EVERY = 4
BASE_CONFIG = {
    "model": "tiny", "tokenizer": "bpe:320", "block_size": 32, "batch_size_per_worker": 4, "max_steps": STEPS,
    "warmup_steps": 4, "learning_rate": 3e-3, "checkpoint_every_steps": CHECKPOINT_EVERY, "collective_timeout_s": 60,
}
SUMMARY_KEYS = {
    "num_workers", "global_batch_size", "steps", "tokens_seen", "wall_time_s", "train_time_s", "tokens_per_s",
    "final_loss", "mfu", "resumed_from_step", "hardware", "versions", "config", "started_at", "finished_at",
}
METRIC_KEYS = {"step", "loss", "learning_rate", "tokens_per_s", "step_time_s", "input_wait_s", "tokens_seen", "time"}
# Same data, same init, same summation order: the curves agree to float32 rounding.
LOSS_TOLERANCE = 1e-4
# The `xla` job is shorter, so its cosine decay starts to differ after the warm-up: the steps up to the warm-up's
# end have the same rates, and XLA's fused float32 operations agree with the plain step to rounding there.
XLA_STEPS = 8
XLA_LOSS_TOLERANCE = 1e-3


class Job:
    """One training job: its config file, output directory and worker processes (one per rank)."""

    def __init__(self, root: Path, name: str, manifest: str, **settings) -> None:
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.config = {**BASE_CONFIG, **settings}
        self.config_path = self.dir / "config.json"
        self.config_path.write_text(json.dumps(self.config))
        self.manifest = manifest
        self.output = self.dir / "output"
        self.tmp = self.dir / "tmp"  # TMPDIR of the workers: non-chief temp saves must vanish from it
        self.tmp.mkdir()
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        workers = self.config.get("num_workers", 1)
        addresses = [f"127.0.0.1:{p}" for p in PortAllocator().allocate(workers)] if workers > 1 else []
        self.procs = []
        for rank in range(workers):
            env = {**os.environ, "TMPDIR": str(self.tmp), "PYTHONPATH": str(REPO)}
            env.pop("TF_CONFIG", None)
            if addresses:
                env["TF_CONFIG"] = json.dumps(
                    {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
                )
            log = (self.dir / f"rank-{rank}.log").open("ab")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "trainer.train", "--config", str(self.config_path), "--manifest",
                 self.manifest, "--output", str(self.output)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            ))

    def wait(self, timeout: float = 240) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(1, deadline - time.monotonic())) for p in self.procs]
        finally:
            self.stop()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def log(self, rank: int) -> str:
        return (self.dir / f"rank-{rank}.log").read_text(errors="replace")

    def losses(self, rank: int = 0) -> dict[int, float]:
        lines = (self.output / "metrics" / f"rank-{rank}.jsonl").read_text().splitlines()
        return {record["step"]: record["loss"] for record in map(json.loads, lines)}

    def summary(self) -> dict:
        return json.loads((self.output / "summary.json").read_text())

    def assert_succeeded(self, codes: list[int]) -> None:
        assert codes == [0] * len(codes), "\n".join(f"--- rank {r}\n{self.log(r)[-4000:]}" for r in range(len(codes)))


def latest_checkpoint_step(checkpoints: Path) -> int | None:
    index = checkpoints / "checkpoint"
    if not index.exists():
        return None
    first = index.read_text().splitlines()[0]  # model_checkpoint_path: "ckpt-N"
    return int(first.rsplit("ckpt-", 1)[1].strip('"'))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> str:
    return write_dataset(tmp_path_factory.mktemp("dataset"), sorted((REPO / "data" / "sample").glob("*.txt")),
                         block_size=32, vocab_size=320, num_train_shards=4, max_chars=40_000)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, manifest) -> dict[str, Job]:
    """Run all three jobs (the resumed one killed and restarted) with as much overlap as 2 cores allow."""
    root = tmp_path_factory.mktemp("runs")
    single = Job(root, "single", manifest, num_workers=1, grad_accum_steps=2)
    pair = Job(root, "pair", manifest, num_workers=2, grad_accum_steps=1)
    resumed = Job(root, "resumed", manifest, num_workers=2, grad_accum_steps=1)
    xla = Job(root, "xla", manifest, num_workers=2, grad_accum_steps=1, xla=True, max_steps=XLA_STEPS,
              checkpoint_every_steps=XLA_STEPS)
    jobs = {"single": single, "pair": pair, "resumed": resumed, "xla": xla}
    try:
        for job in jobs.values():
            job.start()
        # Kill rank 1 of `resumed` as soon as its chief has a checkpoint; rank 0 must then fail on its own.
        deadline = time.monotonic() + 240
        while latest_checkpoint_step(resumed.output / "checkpoints") is None:
            assert time.monotonic() < deadline, resumed.log(0)[-4000:]
            assert resumed.procs[0].poll() is None, resumed.log(0)[-4000:]
            time.sleep(0.05)
        resumed.procs[1].send_signal(signal.SIGKILL)
        resumed.killed_codes = resumed.wait(timeout=120)
        resumed.checkpoint_at_restart = latest_checkpoint_step(resumed.output / "checkpoints")
        resumed.summary_before_restart = (resumed.output / "summary.json").exists()
        resumed.start()
        for job in jobs.values():
            job.assert_succeeded(job.wait())
    finally:
        for job in jobs.values():
            job.stop()
    return jobs


def test_two_workers_follow_the_single_worker_accumulation_curve(runs):
    single, pair = runs["single"].losses(), runs["pair"].losses()
    assert sorted(single) == sorted(pair) == list(range(1, STEPS + 1))
    worst = max(abs(single[s] - pair[s]) for s in single)
    assert worst < LOSS_TOLERANCE, f"loss curves differ by up to {worst}"
    assert single[STEPS] < single[1] - 0.5, "the model did not learn"
    # Both ranks log the same (all-reduced) loss.
    assert runs["pair"].losses(rank=1) == pair


def test_xla_compiles_the_step_and_follows_the_plain_curve(runs):
    xla, pair = runs["xla"], runs["pair"]
    assert "XLA True" in xla.log(0)
    losses, plain = xla.losses(), pair.losses()
    assert sorted(losses) == list(range(1, XLA_STEPS + 1))
    same_rates = range(1, BASE_CONFIG["warmup_steps"] + 2)
    for step in same_rates:
        assert losses[step] == pytest.approx(plain[step], abs=XLA_LOSS_TOLERANCE), step
    assert losses[XLA_STEPS] < losses[1] - 0.5, "the compiled step did not learn"
    assert xla.summary()["steps"] == XLA_STEPS


def test_outputs_follow_the_contract(runs):
    for name, workers in (("single", 1), ("pair", 2)):
        job = runs[name]
        summary = job.summary()
        assert SUMMARY_KEYS <= set(summary)
        assert summary["num_workers"] == workers and summary["global_batch_size"] == 8
        assert summary["steps"] == STEPS and summary["tokens_seen"] == STEPS * 8 * 32
        assert summary["resumed_from_step"] == 0 and summary["mfu"] is None
        assert summary["gpu_mem_reserved_mb"] is None and summary["gpu_mem_peak_mb"] is None  # a CPU run
        assert 0 < summary["train_time_s"] < summary["wall_time_s"] and summary["tokens_per_s"] > 0
        assert summary["final_loss"] == job.losses()[STEPS]
        for rank in range(workers):
            records = [json.loads(line) for line in (job.output / "metrics" / f"rank-{rank}.jsonl").open()]
            assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one record per step, none lost
            assert all(METRIC_KEYS <= set(r) for r in records)
            assert all(math.isfinite(r["loss"]) and r["input_wait_s"] >= 0 for r in records)
            # The rate each step used: linear warmup from lr / (warmup + 1) to lr, then cosine decay.
            rates, warmup, peak = [r["learning_rate"] for r in records], BASE_CONFIG["warmup_steps"], \
                BASE_CONFIG["learning_rate"]
            assert rates[0] == pytest.approx(peak / (warmup + 1)) and rates[warmup] == pytest.approx(peak)
            assert rates[:warmup + 1] == sorted(set(rates[:warmup + 1]))
            assert rates[warmup:] == sorted(rates[warmup:], reverse=True) and rates[-1] < peak / 2
        assert list((job.output / "tensorboard").glob("events.out.tfevents.*"))
        model_files = {p.name for p in (job.output / "model").iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= model_files
        # The chief's serving exports, each read back and matching the trained model (trainer/export.py); with
        # two workers the model's variables are the strategy's, compared through a float32 copy.
        exports = json.loads((job.output / "exports" / "exports.json").read_text())
        assert {name: result["passed"] for name, result in exports["formats"].items()} == {
            "safetensors": True, "saved_model": True}, exports["formats"]
        assert exports["prompts"]["count"] == 3 and (job.output / "exports" / "saved_model" / "saved_model.pb").exists()
        assert latest_checkpoint_step(job.output / "checkpoints") == STEPS
        assert not list(job.tmp.rglob("workertemp_*")), "non-chief temporary saves were left behind"
        assert "rank0" in job.log(0) and f"step {STEPS}/{STEPS}" in job.log(0)


def test_killed_worker_resumes_from_its_checkpoint(runs):
    resumed, pair = runs["resumed"], runs["pair"]
    # The survivor of the kill failed by itself (collective error) instead of hanging; no summary was written.
    assert resumed.killed_codes[0] == 3 and not resumed.summary_before_restart
    # Which of TensorFlow's errors reaches rank 0 first is a race: the coordination service naming the silent
    # peer, or the collective itself failing; either way rank 0 names itself and what it lost.
    lost = [line for line in resumed.log(0).splitlines() if "during a collective" in line]
    assert lost and "rank 0 on " in lost[0], resumed.log(0)[-4000:]
    assert "lost rank 1 (host 127.0.0.1, port " in lost[0] or "lost another worker" in lost[0], lost[0]
    checkpoint = resumed.checkpoint_at_restart
    assert checkpoint is not None and 0 < checkpoint < STEPS and checkpoint % CHECKPOINT_EVERY == 0
    summary = resumed.summary()
    assert summary["resumed_from_step"] == checkpoint and summary["steps"] == STEPS
    assert f"resuming at step {checkpoint} of {STEPS}" in resumed.log(0)
    # Each step logged once, and after the restart the run continues exactly as the uninterrupted one.
    losses = resumed.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    reference = pair.losses()
    worst = max(abs(losses[s] - reference[s]) for s in range(checkpoint + 1, STEPS + 1))
    assert worst < LOSS_TOLERANCE, f"resumed run departs from the uninterrupted one by {worst}"


def test_sigterm_ends_a_training_worker_at_once(tmp_path, manifest):
    """TensorFlow's preemption handler swallows SIGTERM; the trainer undoes it, so a stop needs no SIGKILL. With
    preemption checkpoints off (0) the worker ends by the signal; with them on, tests/trainer/test_preemption.py."""
    job = Job(tmp_path, "sigterm", manifest, num_workers=2, max_steps=100_000, checkpoint_every_steps=100_000,
              preemption_checkpoint_s=0)
    job.start()
    try:
        metrics = job.output / "metrics" / "rank-1.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and job.procs[1].poll() is None, job.log(1)[-3000:]
            time.sleep(0.2)
        os.killpg(job.procs[1].pid, signal.SIGTERM)
        sent = time.monotonic()
        assert job.procs[1].wait(timeout=10) == -signal.SIGTERM
        assert time.monotonic() - sent < 5, "the worker kept running after SIGTERM"
    finally:
        job.stop()


# ---------------------------------------------------------------------------------------------------------------
# bad input fails before TensorFlow starts


def write_config(tmp_path: Path, **settings) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE_CONFIG, **settings}))
    return str(path)


def tf_config(workers: int, rank: int = 0) -> dict[str, str]:
    addresses = [f"127.0.0.1:{20000 + i}" for i in range(workers)]
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})}


@pytest.mark.parametrize(
    ("settings", "environ", "error", "message"),
    [
        ({"num_workers": 1, "batch_size": 4}, {}, ConfigError, "Unknown run setting(s) ['batch_size']"),
        ({"num_workers": 1, "batch_size_per_worker": 0}, {}, ConfigError, "'batch_size_per_worker' = 0"),
        ({"num_workers": 1, "batch_size_per_worker": "4"}, {}, ConfigError, "must be an integer"),
        ({"num_workers": 1, "mixed_precision": "fp8"}, {}, ConfigError, "'mixed_precision' = 'fp8'"),
        ({"num_workers": 8, "num_shards": 8}, tf_config(8, 3), DataError, "4 shard(s) for 8 workers"),
        ({"num_workers": 2}, {}, ConfigError, "TF_CONFIG lists 1 workers"),
        ({"num_workers": 1, "max_steps": 0}, {}, ConfigError, "'max_steps' must be resolved"),
        ({"num_workers": 1, "block_size": 64}, {}, ConfigError, "hold sequences of 32 tokens"),
    ],
    ids=["unknown-key", "zero-batch", "string-batch", "wrong-dtype", "shards-fewer-than-workers",
         "workers-mismatch", "unresolved-steps", "block-size-mismatch"],
)
def test_bad_config_fails_at_start(tmp_path, manifest, settings, environ, error, message):
    with pytest.raises(error) as raised:
        plan_job(write_config(tmp_path, **settings), manifest, str(tmp_path / "out"), environ=environ)
    assert message in str(raised.value)


def test_bad_config_exits_before_tensorflow_with_the_reason(tmp_path, manifest):
    """The CLI exits EXIT_PERMANENT (no retry can fix it) naming the key, without importing TensorFlow (seconds, not
    a TF start-up)."""
    probe = (
        "import runpy, sys\n"
        "try:\n    runpy.run_module('trainer.train', run_name='__main__')\n"
        "except SystemExit as e:\n    print('TF_IMPORTED', 'tensorflow' in sys.modules); raise\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, "--config", write_config(tmp_path, num_workers=1, learning_rat=0.1),
         "--manifest", manifest, "--output", str(tmp_path / "out")],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert result.returncode == EXIT_PERMANENT, result.stderr
    assert "cannot start" in result.stderr and "['learning_rat']" in result.stderr
    assert "TF_IMPORTED False" in result.stdout
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# data order


def test_each_slot_reads_its_own_shards_whatever_the_worker_split(tmp_path, manifest):
    """Slot s of the global batch reads the same files for 2 workers x 1 step and 1 worker x 2 steps."""
    def slot_files(workers: int, accum: int, rank: int) -> list[list[str]]:
        job = plan_job(write_config(tmp_path, num_workers=workers, grad_accum_steps=accum), manifest, "out",
                       environ=tf_config(workers, rank) if workers > 1 else {})
        assert job.slot_order
        return [[shard["name"] for shard in slot] for slot in job.slot_shards]

    assert slot_files(1, 2, 0) == slot_files(2, 1, 0) + slot_files(2, 1, 1)
    assert slot_files(1, 4, 0) == slot_files(2, 2, 0) + slot_files(2, 2, 1)
    names = [name for slot in slot_files(1, 4, 0) for name in slot]
    assert len(set(names)) == 4  # every shard in exactly one slot


@pytest.mark.parametrize(("accum", "slot_order"), [(2, True), (8, False)], ids=["per-slot", "per-worker"])
def test_input_stream_shape_and_resume_position(tmp_path, manifest, monkeypatch, accum, slot_order):
    import tempfile

    import numpy as np

    from trainer.train import input_dataset, stage_inputs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the shard cache of this test
    job = plan_job(write_config(tmp_path, num_workers=1, grad_accum_steps=accum), manifest, "out", environ={})
    assert job.slot_order is slot_order  # 4 shards: one per slot for 2 slots, shared by 8 micro-steps
    files = stage_inputs(job)
    fresh = [step.numpy() for step in input_dataset(job, files, start_step=0).take(5)]
    assert fresh[0].shape == (accum, 4, 32) and fresh[0].dtype == np.int32
    resumed = next(iter(input_dataset(job, files, start_step=3))).numpy()
    np.testing.assert_array_equal(resumed, fresh[3])


def test_a_lost_peer_is_named_by_rank_host_and_port():
    from trainer.runtime import WorkerIdentity
    from trainer.strategy import lost_peers

    identity = WorkerIdentity(0, 3, "vm", ("10.0.0.2:4001", "10.0.0.3:4002", "10.0.0.4:4003"))
    error = RuntimeError("Collective ops is aborted by: Error reported from /job:worker/task:0: The following tasks "
                         "are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2\nThe tasks have "
                         "crashed.")
    assert lost_peers(error, identity) == "rank 2 (host 10.0.0.4, port 4003)"
    assert lost_peers(RuntimeError("Connection reset by peer"), identity) == ""
