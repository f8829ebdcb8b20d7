"""AdamW and the fp16 loss scale under tf.distribute.MirroredStrategy on 2 logical CPU devices (tests/trainer/
mirrored_step.py runs the steps in a process of its own): the replicas stay equal, match one device and PyTorch,
and all skip the step whose inf only one replica saw."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("mirrored") / "figures.json"
    done = subprocess.run([sys.executable, "-m", "tests.trainer.mirrored_step", str(out)], cwd=REPO, check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_two_replicas_update_their_copies_alike(figures):
    assert figures["replicas"] == 2
    assert figures["replicas_differ"] == 0.0
    assert figures["iterations"] == [3, 3]


def test_two_replicas_give_the_one_device_update(figures):
    """The all-reduced 1/4 + 3/4 shares equal the whole gradient up to float32 rounding."""
    assert figures["vs_one_device"] < 1e-6
    assert figures["vs_torch"] < 1e-6


def test_every_replica_skips_an_overflow_one_replica_saw(figures):
    assert figures["overflow"] == {"applied": [False, False], "scales": [2.0**14, 2.0**14],
                                   "weights_unchanged": [True, True]}


def test_a_mirrored_checkpoint_resumes_on_one_device(figures):
    assert figures["restored_vs_mirrored"] < 1e-6
