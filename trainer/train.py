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
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tf_multiworker.launcher.log_policy import configure_worker_logging

from trainer import runtime, storage
from trainer.config import ConfigError, RunConfig
from trainer.data import DataError, load_manifest, tokenizer_url, worker_shards
from trainer.layout import TrainOutput

log = logging.getLogger("trainer.train")

PROGRESS_INTERVAL_S = 5.0


@dataclass(frozen=True)
class TrainJob:
    """A checked plan for this worker: what to train, on which shards, where to write."""

    cfg: RunConfig
    manifest: dict[str, Any]
    manifest_url: str
    output: TrainOutput
    identity: runtime.WorkerIdentity
    slot_shards: tuple[tuple[dict[str, Any], ...], ...]  # per micro-step its shards; one group in per-worker order
    slot_order: bool  # True: per-slot data order, identical for every worker/accumulation split

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def is_chief(self) -> bool:
        return self.identity.is_chief

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch_size * self.cfg.block_size


def plan_job(config_url: str, manifest_url: str, output_url: str, environ: dict[str, str] | None = None) -> TrainJob:
    """Validate config, TF_CONFIG and manifest against each other without TensorFlow; raise ConfigError."""
    cfg = RunConfig.from_saved(storage.read_json(config_url))
    if cfg.max_steps <= 0:
        raise ConfigError(f"{config_url}: 'max_steps' must be resolved (> 0) before training, got {cfg.max_steps}.")
    identity = runtime.worker_identity(environ)
    where = f"rank {identity.rank} on {identity.host}"
    if identity.num_workers != cfg.num_workers:
        raise ConfigError(
            f"{where}: TF_CONFIG lists {identity.num_workers} workers but the config {config_url} says "
            f"'num_workers' = {cfg.num_workers}: launch as many workers as the config names."
        )
    manifest = load_manifest(manifest_url)
    if manifest["block_size"] != cfg.block_size:
        raise ConfigError(
            f"{where}: the shards of {manifest_url} hold sequences of {manifest['block_size']} tokens but "
            f"'block_size' = {cfg.block_size}: re-prepare the dataset or set 'block_size' to match."
        )
    vocab_size = manifest["tokenizer"]["vocab_size"]
    expected_dtype = "uint16" if vocab_size <= 65536 else "uint32"
    if manifest["dtype"] != expected_dtype:
        raise ConfigError(
            f"{where}: {manifest_url} stores tokens as {manifest['dtype']} but a vocabulary of {vocab_size} "
            f"needs {expected_dtype}: the manifest is inconsistent, re-prepare the dataset."
        )
    # Raises naming the counts when there are fewer shards than workers.
    worker_shards(manifest, "train", identity.rank, identity.num_workers)

    micro_steps = cfg.grad_accum_steps
    num_slots = cfg.num_workers * micro_steps
    if len(manifest["splits"]["train"]["shards"]) >= num_slots:
        first = identity.rank * micro_steps
        slots = tuple(
            tuple(worker_shards(manifest, "train", slot, num_slots)) for slot in range(first, first + micro_steps)
        )
        return TrainJob(cfg, manifest, manifest_url, TrainOutput(output_url), identity, slots, True)
    # Too few shards for one per slot: the worker's shards feed all its micro-steps in turn (still a correct
    # run, but its data order differs from a split of the same global batch over other worker counts).
    own = tuple(worker_shards(manifest, "train", identity.rank, identity.num_workers))
    return TrainJob(cfg, manifest, manifest_url, TrainOutput(output_url), identity, (own,), False)


# ---------------------------------------------------------------------------------------------------------------
# TensorFlow from here on


def create_strategy(cfg: RunConfig, multi_worker: bool):
    """The distribution strategy; with TF_CONFIG it is the first TF object created in the process."""
    import tensorflow as tf

    if not cfg.use_gpu:
        tf.config.set_visible_devices([], "GPU")
    elif not tf.config.list_physical_devices("GPU"):
        raise RuntimeError(
            f"'use_gpu' is true but TensorFlow sees no GPU on {runtime.worker_identity().host} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): set 'use_gpu' false or fix the driver."
        )
    if not multi_worker:
        return tf.distribute.get_strategy()
    implementation = {
        "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
        "ring": tf.distribute.experimental.CommunicationImplementation.RING,
        "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
    }[cfg.communication]
    # No per-collective timeout: TF 2.21 parks one sleeping thread per collective for the whole timeout
    # (tensorflow#62466), +2 threads per step until pthread_create fails. Hangs are bounded without it: a peer
    # that exits or stops misses the coordination service's heartbeats and the others' collectives abort (exit
    # 3); a peer alive but stuck leaves the group silent and the launcher's hang watchdog ends it. The retry
    # resumes from the last checkpoint.
    options = tf.distribute.experimental.CommunicationOptions(implementation=implementation)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    runtime.end_on_sigterm()
    return strategy


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


class TrainState:
    """Model, optimizer and step counter under the strategy, with the compiled step function."""

    def __init__(self, job: TrainJob, strategy, work_dir: Path) -> None:
        import tensorflow as tf

        from trainer.model import build_model, causal_lm_loss
        from trainer.optim import GRAD_CLIP_NORM, learning_rate_schedule, make_optimizer

        cfg = job.cfg
        self.strategy = strategy
        with strategy.scope():
            self.model = build_model(
                cfg.model, vocab_size=job.manifest["tokenizer"]["vocab_size"],
                eos_token_id=job.manifest["tokenizer"]["eos_token_id"], block_size=cfg.block_size, work_dir=work_dir,
            )
            self.schedule = learning_rate_schedule(cfg)
            self.optimizer = make_optimizer(cfg, self.schedule)
            self.optimizer.build(self.model.trainable_variables)
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="train_step")
        self.checkpoint = tf.train.Checkpoint(model=self.model, optimizer=self.optimizer, step=self.step)

        model, optimizer, variables = self.model, self.optimizer, self.model.trainable_variables
        micro_steps = cfg.grad_accum_steps
        # Each micro-step's loss is scaled so that summing over micro-steps and replicas gives the mean.
        gradient_scale = 1.0 / (micro_steps * strategy.num_replicas_in_sync)
        loss_scaling = cfg.mixed_precision == "fp16"

        def micro_step(tokens):
            with tf.GradientTape() as tape:
                loss = causal_lm_loss(model, tokens, training=True)
                scaled = loss * gradient_scale
                if loss_scaling:
                    scaled = optimizer.get_scaled_loss(scaled)
            gradients = tape.gradient(scaled, variables)
            if loss_scaling:
                gradients = optimizer.get_unscaled_gradients(gradients)
            return [tf.convert_to_tensor(g) for g in gradients], loss

        @tf.function(jit_compile=cfg.xla)
        def accumulate_gradients(micro_batches):
            if micro_steps == 1:  # nothing to add up: no zero buffers and no loop, ops a small model's step feels
                return micro_step(micro_batches[0])
            gradients = [tf.zeros_like(v) for v in variables]
            loss_sum = tf.constant(0.0)
            for index in tf.range(micro_steps):
                micro_gradients, loss = micro_step(micro_batches[index])
                gradients = [total + g for total, g in zip(gradients, micro_gradients)]
                loss_sum += loss
            return gradients, loss_sum / micro_steps

        def replica_step(micro_batches):
            gradients, loss = accumulate_gradients(micro_batches)
            context = tf.distribute.get_replica_context()
            gradients = context.all_reduce(tf.distribute.ReduceOp.SUM, gradients)
            gradients, norm = tf.clip_by_global_norm(gradients, GRAD_CLIP_NORM)
            optimizer.apply_gradients(zip(gradients, variables), skip_gradients_aggregation=True)
            return loss, norm

        schedule = self.schedule

        @tf.function
        def train_step(micro_batches):
            # This step's rate, read before apply_gradients advances the count: in the graph, not as eager ops
            # between steps (which cost the tiny model a few percent of its step time).
            learning_rate = schedule(optimizer.iterations)
            loss, norm = strategy.run(replica_step, args=(micro_batches,))
            mean = tf.distribute.ReduceOp.MEAN
            return strategy.reduce(mean, loss, axis=None), strategy.reduce(mean, norm, axis=None), learning_rate

        self.train_step = train_step

    def check_same_step_everywhere(self, rank: int) -> None:
        """Every worker must resume from the same checkpoint, or the all-reduces would mix different steps."""
        import tensorflow as tf

        own = tf.reshape(self.step.read_value(), [1])
        restored = sorted(set(self.strategy.gather(self.strategy.run(lambda: own), axis=0).numpy().tolist()))
        if len(restored) > 1:
            raise RuntimeError(
                f"rank {rank} restored step {int(own[0])} but the workers restored steps {restored}: their "
                "checkpoint directories differ. Give every worker the same --output."
            )


class OutputFiles:
    """This worker's local copy of the output's metrics/tensorboard files, published to object storage if remote."""

    def __init__(self, job: TrainJob, work_dir: Path) -> None:
        self.output = job.output
        self.rank = job.rank
        fs, path = storage.filesystem(job.output.url)
        self.remote = not storage.is_local(fs)
        self.root = work_dir / "output" if self.remote else Path(path)
        self.metrics_file = self.root / "metrics" / f"rank-{job.rank}.jsonl"
        self.tensorboard = self.root / "tensorboard"
        if self.remote and storage.exists(job.output.metrics_file(job.rank)):
            storage.download_file(job.output.metrics_file(job.rank), self.metrics_file)

    def publish(self, include_tensorboard: bool) -> None:
        if not self.remote:
            return
        if self.metrics_file.exists():
            storage.upload_file(self.metrics_file, self.output.metrics_file(self.rank))
        if include_tensorboard and self.tensorboard.exists():
            storage.upload_tree(self.tensorboard, self.output.tensorboard)


def export_model(job: TrainJob, model, work_dir: Path) -> None:
    """Chief: model + tokenizer to `TrainOutput.model`, complete or absent. Others: a temp save, then removed."""
    if not job.is_chief:
        scratch = Path(tempfile.mkdtemp(prefix=f"workertemp_{job.rank}_model_"))
        model.save_pretrained(str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)
        return
    from transformers import AutoTokenizer

    from trainer.model import stage_model_dir

    tokenizer = AutoTokenizer.from_pretrained(stage_model_dir(tokenizer_url(job.manifest_url, job.manifest), work_dir))
    fs, path = storage.filesystem(job.output.model)
    local = storage.is_local(fs)
    staging = Path(path).parent / f".model-{os.getpid()}.tmp" if local else work_dir / "model"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    if local:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(staging, path)
    else:
        storage.remove_tree(job.output.model)
        storage.upload_tree(staging, job.output.model)
    log.info("model and tokenizer saved to %s", job.output.model)


@dataclass
class LoopTimes:
    """Where this attempt's time went; the first step (tracing, compilation) is kept apart from throughput."""

    start_step: int
    step: int
    loss: float = math.nan
    first_step_s: float | None = None
    timed_from: float | None = None  # end of the first step
    timed_until: float | None = None  # end of the last step (checkpoints in between count, the export not)
    input_wait_s: float = 0.0

    @property
    def timed_steps(self) -> int:
        return max(0, self.step - self.start_step - 1)

    @property
    def train_time_s(self) -> float:
        return self.timed_until - self.timed_from if self.timed_steps else 0.0


def train_loop(job: TrainJob, state: TrainState, store, outputs: OutputFiles, gpu, start_step: int,
               local_files: list[list[str]]) -> LoopTimes:
    """Steps from `start_step` to `max_steps`: metrics every step, checkpoints every `checkpoint_every_steps`."""
    from trainer.metrics import LiveMetrics, LossWatch, MetricsLog, ProgressPrinter, TensorBoardLog

    cfg = job.cfg
    # One replica per worker, so the batch goes to `strategy.run` as a plain tensor: a tf.data iterator costs
    # far less per step than a distributed one (measured in bench_trainer), and token ids are small to copy.
    iterator = iter(input_dataset(job, local_files, start_step))
    metrics = MetricsLog(outputs.metrics_file, start_step)
    tensorboard = TensorBoardLog(outputs.tensorboard) if job.is_chief else None
    progress = ProgressPrinter(cfg.max_steps, PROGRESS_INTERVAL_S)
    live = LiveMetrics(cfg.max_steps)
    watch = LossWatch(job.rank, cfg.max_loss_rise)
    times = LoopTimes(start_step=start_step, step=start_step)
    while times.step < cfg.max_steps:
        begin = time.perf_counter()
        micro_batches = next(iterator)
        fetched = time.perf_counter()
        loss_tensor, grad_norm, learning_rate = state.train_step(micro_batches)
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
        if step % cfg.checkpoint_every_steps == 0 or step == cfg.max_steps:
            state.step.assign(step)  # only the checkpoint reads it: an eager op per step costs small models ~0.1%
            with runtime.writing_checkpoint():
                store.save(step)
            if tensorboard:
                tensorboard.flush()
            outputs.publish(job.is_chief)
    metrics.close()
    if tensorboard:
        tensorboard.close()
    outputs.publish(job.is_chief)
    return times


def build_summary(job: TrainJob, state: TrainState, times: LoopTimes, outputs: OutputFiles, gpu, started: float,
                  started_at: str) -> dict[str, Any]:
    from trainer.metrics import hardware_info, versions
    from trainer.model import flops_per_token

    cfg = job.cfg
    train_time = times.train_time_s
    tokens_per_s = times.timed_steps * job.tokens_per_step / train_time if train_time > 0 else None
    peak = gpu.peak_flops()
    mfu = (
        tokens_per_s * flops_per_token(state.model, cfg.block_size) / (peak * cfg.num_workers)
        if tokens_per_s and peak else None
    )
    # Restarted after the last checkpoint: nothing was trained now, the final loss is the logged one.
    final_loss = times.loss if times.step > times.start_step else last_logged_loss(outputs.metrics_file)
    return {
        "num_workers": cfg.num_workers, "global_batch_size": cfg.global_batch_size, "steps": times.step,
        "tokens_seen": times.step * job.tokens_per_step, "wall_time_s": round(time.perf_counter() - started, 3),
        "train_time_s": round(train_time, 3), "tokens_per_s": tokens_per_s, "final_loss": final_loss, "mfu": mfu,
        "resumed_from_step": times.start_step, "first_step_s": times.first_step_s, "steps_timed": times.timed_steps,
        "input_wait_fraction": times.input_wait_s / train_time if train_time > 0 else None,
        "data_order": "per_slot" if job.slot_order else "per_worker",
        # The gradients' size, for the scaling advisor when this summary stands in for its probe.
        "parameters": int(sum(v.shape.num_elements() for v in state.model.trainable_variables)),
        "gradient_dtype": state.model.trainable_variables[0].dtype.name,
        "hardware": hardware_info(gpu.name, "GPU" if cfg.use_gpu else "CPU"), "versions": versions(),
        "config": cfg.to_dict(), "started_at": started_at, "finished_at": utc_now(),
    }


def train(job: TrainJob, strategy, started: float, started_at: str) -> dict[str, Any] | None:
    """Restore the latest checkpoint, train to `max_steps`, export; the chief returns the summary."""
    import tf_keras

    from trainer.checkpoint import CheckpointStore
    from trainer.metrics import GpuSampler
    from trainer.optim import set_precision_policy

    cfg = job.cfg
    tf_keras.utils.set_random_seed(cfg.seed)
    policy = set_precision_policy(cfg)
    work_dir = Path(tempfile.mkdtemp(prefix=f"trainer-rank{job.rank}-"))
    try:
        local_files = stage_inputs(job)
        state = TrainState(job, strategy, work_dir)
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
            cfg.batch_size_per_worker, cfg.num_workers, cfg.grad_accum_steps, policy, cfg.xla,
            "per slot" if job.slot_order else "per worker (fewer shards than slots)",
        )
        outputs = OutputFiles(job, work_dir)
        gpu = GpuSampler(cfg.use_gpu)
        times = train_loop(job, state, store, outputs, gpu, start_step, local_files)
        export_model(job, state.model, work_dir)
        store.close()
        return build_summary(job, state, times, outputs, gpu, started, started_at) if job.is_chief else None
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def last_logged_loss(metrics_file: Path) -> float | None:
    lines = [line for line in metrics_file.read_text().splitlines() if line] if metrics_file.exists() else []
    return json.loads(lines[-1])["loss"] if lines else None


def collective_error_reason(error: Exception) -> str:
    """The lines of a TF collective error that name the cause (`str(error)` opens with a node traceback)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if "aborted by" in line or "unhealthy" in line or line.startswith("RPC:"):
            reason = line
            if line.endswith(":") and index + 1 < len(lines):  # "... unhealthy (stopped sending heartbeats):" + task
                reason += " " + lines[index + 1]
            return reason
    return lines[0] if lines else type(error).__name__


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="RunConfig JSON (path or URL), max_steps resolved")
    parser.add_argument("--manifest", required=True, help="manifest.json of the tokenized dataset")
    parser.add_argument("--output", required=True, help="TrainOutput directory (path or URL)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started, started_at = time.perf_counter(), utc_now()
    args = parse_args(argv)
    identity = runtime.worker_identity()
    configure_worker_logging(logging.WARNING, f"%(asctime)s rank{identity.rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("trainer").setLevel(logging.INFO)  # ours at INFO; TF/botocore chatter stays at WARNING
    try:
        job = plan_job(args.config, args.manifest, args.output)
    except (DataError, ValueError) as error:  # ConfigError is a ValueError
        log.error("rank %d on %s: cannot start: %s", identity.rank, identity.host, error)
        return 2
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
    import tensorflow as tf

    try:
        summary = train(job, strategy, started, started_at)
    except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError, tf.errors.CancelledError) as error:
        # TensorFlow's coordination service stopped hearing from a peer (it exited, crashed or was stopped) and
        # aborted this worker's collectives. The group must restart together; it resumes from the checkpoint.
        log.error(
            "rank %d on %s lost another worker during a collective (%s: %s): a peer exited or stopped answering "
            "its heartbeats; its own log names the cause. Restart the whole group; it resumes from the latest "
            "checkpoint in %s.", job.rank, job.identity.host, type(error).__name__, collective_error_reason(error),
            job.output.checkpoints,
        )
        return 3
    if summary is not None:
        storage.write_json_atomic(job.output.summary, summary)
        log.info("summary written to %s: %s tokens/s, final loss %.4f", job.output.summary,
                 f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "n/a", summary["final_loss"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
