"""AdamW and the loss scale under MirroredStrategy on 2 logical CPUs: `python -m tests.trainer.mirrored_step OUT`.

A process of its own: logical devices must be set before TensorFlow starts, which a test process has already
done. Writes OUT (JSON) with what tests/trainer/test_mirrored_step.py checks:
- `replicas_differ`: the largest difference between the two replicas' copies of any weight or moment after the
  fixture's steps (the gradients split 1:3 over the replicas, all-reduced in the replica context, applied there);
- `vs_one_device`: the largest difference from the same steps on one device with the whole gradients;
- `vs_torch`: the largest difference from torch.optim.AdamW's weights (fixtures/torch_adamw.npz);
- `overflow`: a step whose inf is in replica 1's share only: whether each replica applied it, each replica's
  scale after, and whether each replica's weights stayed as they were;
- `restored_vs_mirrored`: the mirrored checkpoint read on one device, the largest difference after one more step.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import tensorflow as tf

from tests.trainer.test_adamw import FIXTURE as TORCH
from tests.trainer.test_adamw import NAMES, STEPS, WEIGHT_DECAY, fixture_gradients, fixture_rate, fixture_variables
from trainer.adamw import AdamW
from trainer.precision import LossScale

SHARES = (0.25, 0.75)  # of each gradient, per replica: their sum is the whole gradient


def largest_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def build(strategy: tf.distribute.Strategy) -> tuple[list[tf.Variable], AdamW, LossScale]:
    with strategy.scope():
        variables = fixture_variables()
        return variables, AdamW(variables, fixture_rate, weight_decay=WEIGHT_DECAY), LossScale()


def distributed_step(strategy, optimizer: AdamW, loss_scale: LossScale):
    """One step as train.py takes it: each replica's gradients, summed across replicas, applied in the replica."""

    @tf.function
    def step(shares):
        def replica_step(local):
            reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, local)
            return loss_scale.apply_gradients(optimizer, reduced)

        return strategy.experimental_local_results(strategy.run(replica_step, args=(shares,)))

    return step


def replica_shares(strategy, gradients: list[tf.Tensor], poison_replica: int | None = None):
    def share(context):
        index = context.replica_id_in_sync_group
        local = [g * SHARES[index] for g in gradients]
        if index == poison_replica:
            local[0] = local[0] + np.inf
        return local

    return strategy.experimental_distribute_values_from_function(share)


def copies(strategy, values) -> list[list[np.ndarray]]:
    """Each replica's copy of `values` (mirrored variables), replica by replica."""
    per_value = [[c.numpy() for c in strategy.experimental_local_results(v)] for v in values]
    return [list(replica) for replica in zip(*per_value)]


def main(out: Path) -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    variables, optimizer, loss_scale = build(strategy)
    single_variables, single, _ = build(tf.distribute.get_strategy())
    step = distributed_step(strategy, optimizer, loss_scale)
    for index in range(1, STEPS + 1):
        step(replica_shares(strategy, fixture_gradients(index)))
        single.apply_gradients(fixture_gradients(index))
    state = [*variables, *optimizer.first_moments.values(), *optimizer.second_moments.values()]
    first, second = copies(strategy, state)
    figures = {
        "replicas": strategy.num_replicas_in_sync,
        "replicas_differ": largest_difference(first, second),
        "vs_one_device": largest_difference(first[:len(NAMES)], [v.numpy() for v in single_variables]),
        "vs_torch": largest_difference(first[:len(NAMES)], [TORCH[f"after/{STEPS}/{n}"] for n in NAMES]),
        "iterations": [int(c) for c in strategy.experimental_local_results(optimizer.iterations)],
    }
    before = copies(strategy, variables)
    applied = step(replica_shares(strategy, fixture_gradients(STEPS), poison_replica=1))
    after = copies(strategy, variables)
    figures["overflow"] = {
        "applied": [bool(a) for a in applied],
        "scales": [float(c) for c in strategy.experimental_local_results(loss_scale.scale)],
        "weights_unchanged": [largest_difference(b, a) == 0.0 for b, a in zip(before, after)],
    }
    with tempfile.TemporaryDirectory() as scratch:
        saved = tf.train.Checkpoint(variables=variables, optimizer=optimizer).write(f"{scratch}/ckpt")
        restored_variables, restored, _ = build(tf.distribute.get_strategy())
        tf.train.Checkpoint(variables=restored_variables, optimizer=restored).read(saved).assert_consumed()
    step(replica_shares(strategy, fixture_gradients(1)))
    restored.apply_gradients(fixture_gradients(1))
    figures["restored_vs_mirrored"] = largest_difference(copies(strategy, variables)[0],
                                                         [v.numpy() for v in restored_variables])
    out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
