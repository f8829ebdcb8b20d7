"""A small real MultiWorkerMirroredStrategy job: a linear model trained by SGD on random data, core TF only.

`--steps` and `--step-sleep` set the length; every step prints one line. Used where a test needs a genuine TF
multi-worker run (collectives over gRPC) rather than the socket stand-in.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tensorflow as tf

from trainer.runtime import signal_ready, worker_identity

LEARNING_RATE = 0.01


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    args = parser.parse_args()
    me = worker_identity()
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    signal_ready()
    rng = np.random.default_rng(me.rank)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    batches = iter(tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8))
    with strategy.scope():
        weight = tf.Variable(tf.zeros([4, 1]), name="weight")

    @tf.function
    def step(features, targets):
        def replica_step(features, targets):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(features @ weight - targets))
            gradient = tf.distribute.get_replica_context().all_reduce("mean", tape.gradient(loss, weight))
            weight.assign_sub(LEARNING_RATE * gradient)
            return loss

        return strategy.reduce("mean", strategy.run(replica_step, args=(features, targets)), axis=None)

    for index in range(args.steps):
        loss = step(*next(batches))
        print(f"rank {me.rank} step {index} loss {float(loss):.4f}", flush=True)
        time.sleep(args.step_sleep)
    print(f"rank {me.rank} finished", flush=True)


if __name__ == "__main__":
    main()
