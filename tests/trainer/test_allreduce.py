"""Gradient communication (trainer/allreduce.py): the packs TF builds, bfloat16 on the wire against float32, the
float32 default against the one-worker baseline, and one gradient all-reduce per step.

Four tiny jobs train side by side on loopback (60 steps of 8 sequences, the same data and initialisation):
- `baseline`: 1 worker x batch 4 x 2 accumulation steps, float32 (its all-reduce is the identity);
- `float32`: 2 workers x batch 4, float32 on the wire, default packs (one, for a model this small);
- `bfloat16`: the same with bfloat16 on the wire and small packs, so there are several;
- `one_pack`: bfloat16 in one pack after the backward pass (`allreduce_pack_mb` = 0).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from core.config import ConfigError, RunConfig
from tests.trainer.shards import write_dataset
from tests.trainer.test_train import REPO, Job
from trainer import advisor
from trainer.allreduce import GradientReducer, PackRecorder

STEPS = 60
SETTINGS = {"max_steps": STEPS, "checkpoint_every_steps": STEPS, "warmup_steps": 6}
SMALL_PACK_MB = 0.05  # the tiny model sends 0.26 MiB in bfloat16: several packs
# bfloat16 keeps 8 significant bits: a relative rounding of 2^-8 per gradient value, far below minibatch noise.
STEP_LOSS_RELATIVE = 1e-2
EVAL_LOSS_NATS = 0.02
# Same data, same initialisation, the same summation order: float32 on the wire agrees with the baseline to float32
# rounding. Not bit for bit: oneDNN's multithreaded matmuls round differently from run to run, and over 60 steps
# that drifts to a few units in the last place (up to 7.2e-7 relative measured before this module existed).
EXACT_RELATIVE = 1e-6


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> str:
    return write_dataset(tmp_path_factory.mktemp("dataset"), sorted((REPO / "data" / "sample").glob("*.txt")),
                         block_size=32, vocab_size=320, num_train_shards=4, max_chars=40_000)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, manifest) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("allreduce")
    started = {
        "baseline": Job(root, "baseline", manifest, num_workers=1, grad_accum_steps=2, **SETTINGS),
        "float32": Job(root, "float32", manifest, num_workers=2, **SETTINGS),
        "bfloat16": Job(root, "bfloat16", manifest, num_workers=2, allreduce_dtype="bfloat16",
                        allreduce_pack_mb=SMALL_PACK_MB, **SETTINGS),
        "one_pack": Job(root, "one_pack", manifest, num_workers=2, allreduce_dtype="bfloat16", allreduce_pack_mb=0,
                        **SETTINGS),
    }
    try:
        for job in started.values():
            job.start()
        for job in started.values():
            job.assert_succeeded(job.wait(timeout=480))
    finally:
        for job in started.values():
            job.stop()
    return started


def eval_loss(job: Job, manifest: str) -> float:
    out = job.dir / "eval.json"
    done = subprocess.run([sys.executable, "-m", "trainer.evaluate", "--model", str(job.output / "model"),
                           "--manifest", manifest, "--output", str(out)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TF_CONFIG": ""}, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["eval_loss"]


def test_packs_follow_tf_grouping():
    import tensorflow as tf
    from tensorflow.python.distribute import cross_device_utils

    sizes = [7, 100, 3, 60, 60, 1, 250]
    tensors = [tf.zeros([n]) for n in reversed(sizes)]  # TF packs the reversed list
    for pack_bytes in (0, 1, 200, 400, 4000):
        expected = [sum(t.shape.num_elements() * 4 for t in pack)
                    for pack in cross_device_utils.group_by_size(tensors, pack_bytes)]
        assert advisor.pack_sizes([n * 4 for n in sizes], pack_bytes) == expected


def test_the_recorder_reads_tfs_trace_line_and_refuses_a_second_gradient_all_reduce():
    line = ("Collective all_reduce tensors: %d all_reduces, num_devices = %d, group_size = %d, implementation = %s, "
            "num_packs = %d")
    with PackRecorder() as recorder:
        tf_log = logging.getLogger("tensorflow")
        tf_log.info(line, 148, 1, 2, "CommunicationImplementation.AUTO", 3)
        tf_log.info(line, 1, 1, 2, "CommunicationImplementation.AUTO", 1)
    assert recorder.calls == [(148, 3), (1, 1)] and recorder.gradient_packs(148) == 3
    assert recorder.gradient_packs(40) is None
    recorder.calls.append((148, 3))
    with pytest.raises(RuntimeError, match="all-reduces its 148 gradients 2 times"):
        recorder.gradient_packs(148)


def test_the_reducer_all_reduces_over_the_implementation_communication_resolves_to():
    """`auto` with `use_gpu` is NCCL in the reducer's own call-level options too: TF's CommunicationOptions.merge
    keeps a call-level implementation other than AUTO (tensorflow/python/distribute/collective_util.py:158-159 in the
    2.21.0 wheel). bfloat16 never reaches NCCL: no reducer can be built for that pair, the config refuses it."""
    import tensorflow as tf

    implementations = tf.distribute.experimental.CommunicationImplementation
    on_gpu = GradientReducer(RunConfig(use_gpu=True))
    assert (on_gpu.implementation, on_gpu._options.implementation) == ("nccl", implementations.NCCL)
    assert on_gpu._options.bytes_per_pack == 32 * 2**20  # the packs travel with the implementation
    on_cpu = GradientReducer(RunConfig(allreduce_dtype="bfloat16"))
    assert (on_cpu.implementation, on_cpu._options.implementation) == ("ring", implementations.RING)
    ring_on_gpu = GradientReducer(RunConfig(use_gpu=True, communication="ring", allreduce_dtype="bfloat16"))
    assert ring_on_gpu._options.implementation == implementations.RING
    with pytest.raises(ConfigError, match="'allreduce_dtype' = 'bfloat16' cannot go over NCCL"):
        GradientReducer(RunConfig(use_gpu=True, communication="nccl", allreduce_dtype="bfloat16"))


def test_float32_on_the_wire_is_step_exact_with_the_baseline(jobs):
    baseline, pair = jobs["baseline"].losses(), jobs["float32"].losses()
    assert sorted(baseline) == sorted(pair) == list(range(1, STEPS + 1))
    worst = max(abs(baseline[s] - pair[s]) / baseline[s] for s in baseline)
    print(f"\nfloat32 on the wire vs the one-worker baseline: worst relative loss difference {worst:.2e}")
    assert worst <= EXACT_RELATIVE, f"float32 loss curves differ by up to {worst} (relative)"


def test_bfloat16_on_the_wire_stays_on_the_float32_curve(jobs, manifest):
    exact, wire = jobs["float32"].losses(), jobs["bfloat16"].losses()
    worst = max(abs(wire[s] - exact[s]) / exact[s] for s in exact)
    print(f"\nbfloat16 vs float32 on the wire, {STEPS} steps: worst per-step relative loss difference {worst:.2e}")
    assert worst <= STEP_LOSS_RELATIVE
    assert wire != exact, "bfloat16 on the wire changed nothing: the cast did not happen"
    gap = abs(eval_loss(jobs["bfloat16"], manifest) - eval_loss(jobs["float32"], manifest))
    print(f"eval loss difference: {gap:.4f} nats")
    assert gap <= EVAL_LOSS_NATS


def test_the_gradients_cross_once_in_the_configured_packs(jobs):
    for name, dtype, pack_mb in (("float32", "float32", 32.0), ("bfloat16", "bfloat16", SMALL_PACK_MB),
                                 ("one_pack", "bfloat16", 0.0)):
        summary = jobs[name].summary()
        wire_bytes = 2 if dtype == "bfloat16" else 4
        expected = len(advisor.pack_sizes([n * wire_bytes for n in summary["variable_parameters"]],
                                          int(pack_mb * 2**20)))
        assert summary["allreduce"] == {"implementation": "ring", "dtype": dtype, "pack_mb": pack_mb,
                                        "packs": expected, "overlap": expected > 1}, name
    assert jobs["bfloat16"].summary()["allreduce"]["packs"] > 1
    assert jobs["one_pack"].summary()["allreduce"]["packs"] == 1
    assert jobs["baseline"].summary()["allreduce"]["packs"] is None  # one worker: nothing crosses the network
    assert "gradients: " in jobs["bfloat16"].log(0) and "overlap the last micro-step's backward pass" in \
        jobs["bfloat16"].log(0)
    assert "MiB in bfloat16 per step over RING in" in jobs["bfloat16"].log(0)
