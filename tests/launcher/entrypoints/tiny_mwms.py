"""A small real MultiWorkerMirroredStrategy job: a two-layer Keras model fitted on random data.

`--steps` and `--step-sleep` set the length; every step prints one line. Used where a test needs a genuine TF
multi-worker run (collectives over gRPC) rather than the socket stand-in.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tensorflow as tf
import tf_keras as keras

from trainer.runtime import signal_ready, worker_identity


class _PrintStep(keras.callbacks.Callback):
    def __init__(self, rank: int, sleep_s: float) -> None:
        super().__init__()
        self.rank, self.sleep_s = rank, sleep_s

    def on_train_batch_end(self, batch, logs=None):
        print(f"rank {self.rank} step {batch} loss {logs['loss']:.4f}", flush=True)
        time.sleep(self.sleep_s)


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
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(8 * me.num_workers)
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(8, activation="relu", input_shape=(4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    model.fit(dataset, steps_per_epoch=args.steps, epochs=1, verbose=0,
              callbacks=[_PrintStep(me.rank, args.step_sleep)])
    print(f"rank {me.rank} finished", flush=True)


if __name__ == "__main__":
    main()
