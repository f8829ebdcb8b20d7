"""Train GPT-2 on the manifest's shards: one entry point for one worker (no TF_CONFIG) and for N workers.

    python -m trainer.train --config URL --manifest URL --output URL

Everything that can be checked without TensorFlow (config, manifest, shard split, TF_CONFIG) is checked first, so
a bad run fails in a second. Then `MultiWorkerMirroredStrategy` is created before any other TF op, the worker
signals the launcher, and a custom loop trains: one `strategy.run` per optimizer step, gradients accumulated
over micro-batches on each worker, all-reduced once, clipped, applied by AdamW.

Data order: the global batch of a step is made of `num_workers x grad_accum_steps` slots of
`batch_size_per_worker` sequences. Slot s always reads the same shard files in the same seeded order, whichever
worker computes it, so 2 workers x 1 micro-step, 1 worker x 2 micro-steps (the baseline) and any other split of
the same global batch see the same sequences at every step and follow the same loss curve.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from core.protocol import EXIT_PEER_LOST, EXIT_PERMANENT, EXIT_PREEMPTED
from launcher.log_policy import configure_worker_logging
from trainer import runtime
from trainer.data import DataError
from trainer.job import TrainJob, plan_job
from trainer.outputs import LoopTimes, OutputFiles, Started, build_summary, export_model, write_summary
from trainer.step import TrainState
from trainer.strategy import collective_error_reason, create_strategy, lost_peers

log = logging.getLogger("trainer.train")

PROGRESS_INTERVAL_S = 5.0
PREEMPTED = {"preempted": True}  # what `train` returns when it stopped on a preemption notice


# ---------------------------------------------------------------------------------------------------------------
# TensorFlow from here on


def input_dataset(job: TrainJob, local_files: list[list[str]], start_step: int):
    """This worker's stream of optimizer steps: int32 [grad_accum_steps, batch_size_per_worker, block_size]."""
    import tensorflow as tf

    from trainer.data import make_dataset

    cfg = job.cfg

    def shard_stream(files: list[str]):
        return make_dataset(
            files, block_size=cfg.block_size, dtype=job.manifest["dtype"], batch_size=cfg.batch_size_per_worker,
            shuffle=True, seed=cfg.seed, repeat=True,
        )

    if job.slot_order:
        streams = tuple(shard_stream(files) for files in local_files)
        steps = tf.data.Dataset.zip(streams).map(lambda *micro: tf.stack(micro))
    else:
        steps = shard_stream(local_files[0]).batch(cfg.grad_accum_steps, drop_remainder=True)
    # Resuming at step k replays the same seeded order and drops what steps 1..k consumed.
    return steps.skip(start_step).prefetch(tf.data.AUTOTUNE)


def stage_inputs(job: TrainJob) -> list[list[str]]:
    """Copy and verify this worker's shards into this user's per-dataset cache that a retry or the baseline reuses,
    held for the rest of this process; idle datasets make way when the disk lacks room (trainer/shard_cache.py)."""
    from trainer import shard_cache
    from trainer.data import shard_cache_dir, stage_shards

    cache = shard_cache_dir(job.manifest["fingerprint"])
    shard_cache.hold(cache)
    shard_cache.make_room(cache, shard_cache.missing_bytes(cache, [s for shards in job.slot_shards for s in shards]))
    return [stage_shards(job.manifest_url, list(shards), cache) for shards in job.slot_shards]


def save_checkpoint(job: TrainJob, state: TrainState, store, outputs: OutputFiles, tensorboard, step: int) -> None:
    """Every rank saves (saving runs collectives), the chief's is the real one; then the outputs are published."""
    state.step.assign(step)  # only the checkpoint reads it: an eager op per step costs small models ~0.1%
    with runtime.writing_checkpoint():
        store.save(step)
    if tensorboard:
        tensorboard.flush()
    outputs.publish(job.is_chief)


def train_loop(job: TrainJob, state: TrainState, store, outputs: OutputFiles, gpu, start_step: int,
               local_files: list[list[str]]) -> LoopTimes:
    """Steps from `start_step` to `max_steps`: metrics every step, checkpoints every `checkpoint_every_steps`, and
    at once at the first step whose all-reduced stop flag says a rank got a preemption notice (then
    `times.preempted`)."""
    from trainer.metrics import LiveMetrics, LossWatch, MetricsLog, ProgressPrinter, TensorBoardLog

    cfg = job.cfg
    # One replica per worker, so the batch goes to `strategy.run` as a plain tensor: a tf.data iterator costs
    # far less per step than a distributed one (measured in bench_trainer), and token ids are small to copy.
    iterator = iter(input_dataset(job, local_files, start_step))
    metrics = MetricsLog(outputs.metrics_file, start_step)
    tensorboard = TensorBoardLog(outputs.tensorboard) if job.is_chief else None
    progress = ProgressPrinter(cfg.max_steps, PROGRESS_INTERVAL_S)
    live = LiveMetrics(cfg.max_steps)
    watch = LossWatch(job.rank, cfg.monitoring.max_loss_rise)
    times = LoopTimes(start_step=start_step, step=start_step)
    while times.step < cfg.max_steps:
        begin = time.perf_counter()
        micro_batches = next(iterator)
        fetched = time.perf_counter()
        noticed = runtime.preemption_notice() is not None
        loss_tensor, grad_norm, learning_rate, stop = state.train_step(micro_batches, noticed)
        loss = float(loss_tensor)  # waits for the step: the timings below are real
        end = time.perf_counter()
        step = times.step = times.step + 1
        times.loss = loss
        watch.check(step, loss)
        if times.timed_from is None:
            times.first_step_s, times.timed_from = end - begin, end
        else:
            times.input_wait_s += fetched - begin
        times.timed_until = end
        record = {
            "step": step, "loss": loss, "learning_rate": float(learning_rate),
            "tokens_per_s": job.tokens_per_step / (end - begin), "step_time_s": end - begin,
            "input_wait_s": fetched - begin, "tokens_seen": step * job.tokens_per_step, "time": time.time(),
            "grad_norm": float(grad_norm), **gpu.sample(),
        }
        metrics.write(record)
        live.maybe_print(record)
        if tensorboard:
            tensorboard.write(step, {k: record[k] for k in ("loss", "learning_rate", "tokens_per_s", "grad_norm")})
            seconds_per_step = times.train_time_s / times.timed_steps if times.timed_steps else end - begin
            progress.maybe_print(step, loss, record["learning_rate"], record["tokens_per_s"], seconds_per_step)
        times.preempted = bool(stop)
        if times.preempted or step % cfg.checkpoint_every_steps == 0 or step == cfg.max_steps:
            save_checkpoint(job, state, store, outputs, tensorboard, step)
        if times.preempted:
            log.warning("rank %d: %s; checkpoint of step %d saved, stopping (the next attempt resumes there)",
                        job.rank, "SIGTERM with notice" if noticed else "another rank got SIGTERM with notice", step)
            runtime.preemption_checkpointed()
            break
    metrics.close()
    if tensorboard:
        tensorboard.close()
    outputs.publish(job.is_chief)
    return times


def train(job: TrainJob, strategy, started: Started) -> dict[str, Any] | None:
    """Restore the latest checkpoint, train to `max_steps`, export; the chief returns the summary."""
    from trainer.checkpoint import CheckpointStore
    from trainer.metrics import GpuSampler, tensorflow_peak_mb
    from trainer.precision import Precision
    from trainer.recipe import set_random_seed

    cfg = job.cfg
    set_random_seed(cfg.seed)
    precision = Precision(cfg.mixed_precision)
    work_dir = Path(tempfile.mkdtemp(prefix=f"trainer-rank{job.rank}-"))
    try:
        local_files = stage_inputs(job)
        state = TrainState(job, strategy, precision, work_dir)
        store = CheckpointStore(
            state.checkpoint, job.output.checkpoints, work_dir, rank=job.rank, is_chief=job.is_chief
        )
        store.restore_latest()
        start_step = int(state.step.numpy())
        state.check_same_step_everywhere(job.rank)
        if start_step > cfg.max_steps:
            raise RuntimeError(
                f"rank {job.rank}: the checkpoint in {job.output.checkpoints} is at step {start_step}, beyond "
                f"'max_steps' = {cfg.max_steps}: use a new --output or raise 'max_steps'."
            )
        log.info(
            "rank %d: %s at step %d of %d; global batch %d = %d per worker x %d workers x %d micro-steps; "
            "precision %s, XLA %s; data order %s",
            job.rank, "resuming" if start_step else "starting", start_step, cfg.max_steps, cfg.global_batch_size,
            cfg.batch_size_per_worker, cfg.num_workers, cfg.grad_accum_steps, precision.policy_name, cfg.xla,
            "per slot" if job.slot_order else "per worker (fewer shards than slots)",
        )
        outputs = OutputFiles(job, work_dir)
        gpu = GpuSampler(cfg.use_gpu, read_peak_mb=tensorflow_peak_mb)
        with runtime.preemption_notices(cfg.preemption_checkpoint_s):
            times = train_loop(job, state, store, outputs, gpu, start_step, local_files)
        if times.preempted:
            store.close()
            return PREEMPTED
        export_model(job, state.model, work_dir)
        store.close()
        return build_summary(job, state.model, times, outputs, gpu, started, state.allreduce) if job.is_chief else None
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="RunConfig JSON (path or URL), max_steps resolved")
    parser.add_argument("--manifest", required=True, help="manifest.json of the tokenized dataset")
    parser.add_argument("--output", required=True, help="TrainOutput directory (path or URL)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = Started.now()
    os.environ["HF_HUB_OFFLINE"] = "1"  # models come from storage only: prepare fetched a hub model once
    args = parse_args(argv)
    identity = runtime.worker_identity()
    configure_worker_logging(logging.WARNING, f"%(asctime)s rank{identity.rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("trainer").setLevel(logging.INFO)  # ours at INFO; TF/botocore chatter stays at WARNING
    try:
        job = plan_job(args.config, args.manifest, args.output)
    except (DataError, ValueError) as error:  # ConfigError is a ValueError
        log.error("rank %d on %s: cannot start: %s (a retry cannot fix this: exit %d)", identity.rank, identity.host,
                  error, EXIT_PERMANENT)
        return EXIT_PERMANENT
    if job.is_chief:
        log.info("Run configuration:\n  %s", "\n  ".join(job.cfg.summary_lines()))

    try:
        strategy = create_strategy(job.cfg, multi_worker=bool(os.environ.get("TF_CONFIG")))
    except RuntimeError as error:  # no GPU although use_gpu: a setting or driver problem, not a crash
        log.error("rank %d on %s: cannot start: %s", job.rank, job.identity.host, error)
        return 2
    runtime.signal_ready()
    log.info("rank %d of %d joined (%d replicas in sync)", job.rank, job.identity.num_workers,
             strategy.num_replicas_in_sync)
    if strategy.num_replicas_in_sync != job.identity.num_workers:
        log.error(
            "rank %d on %s: %d replicas for %d workers: each worker must drive exactly one device. Give every "
            "worker one GPU (CUDA_VISIBLE_DEVICES=<index>) or none.", job.rank, job.identity.host,
            strategy.num_replicas_in_sync, job.identity.num_workers,
        )
        return 2
    return run_training(job, strategy, started)


def run_training(job: TrainJob, strategy, started: Started) -> int:
    """Train and write the summary; the exit status tells the launcher what a retry can do (core/protocol.py)."""
    import tensorflow as tf

    from core.config import ConfigError
    from trainer.checkpoint import IncompatibleCheckpointError
    from trainer.metrics import LossDivergedError

    try:
        summary = train(job, strategy, started)
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError) as error:
        # TensorFlow's coordination service stopped hearing from a peer (it exited, crashed or was stopped) and
        # aborted this worker's collectives. The group must restart together; it resumes from the checkpoint.
        peers = lost_peers(error, job.identity)
        if peers:
            log.error(
                "rank %d on %s lost %s during a collective: it stopped sending heartbeats (it exited, hung, or its "
                "host or network went away; its own log may name the cause). Restart the whole group; it resumes "
                "from the latest checkpoint in %s.", job.rank, job.identity.host, peers, job.output.checkpoints)
            return EXIT_PEER_LOST
        log.error(
            "rank %d on %s lost another worker during a collective (%s: %s): a peer exited or stopped answering "
            "its heartbeats; its own log names the cause. Restart the whole group; it resumes from the latest "
            "checkpoint in %s.", job.rank, job.identity.host, type(error).__name__, collective_error_reason(error),
            job.output.checkpoints,
        )
        return EXIT_PEER_LOST
    except (LossDivergedError, DataError, ConfigError, IncompatibleCheckpointError):
        log.error("rank %d on %s: a retry cannot fix this failure: exit %d, the task fails without spending its "
                  "retries", job.rank, job.identity.host, EXIT_PERMANENT)
        traceback.print_exc()  # its last line names the error: the task's failure reason and alerts quote it
        return EXIT_PERMANENT
    if summary is PREEMPTED:
        return EXIT_PREEMPTED
    if summary is not None:
        write_summary(job, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
