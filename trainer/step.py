"""One optimizer step under the strategy: each replica's gradients over its micro-batches, their all-reduce, the
clipped AdamW update, and the state (model, optimizer, step counter) a checkpoint holds.

Imports TensorFlow only inside functions: trainer/train.py imports this before TensorFlow is set up.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from core.config import RunConfig
from trainer.allreduce import GradientReducer, PackRecorder
from trainer.job import TrainJob

log = logging.getLogger("trainer.train")


def micro_step_function(cfg: RunConfig, model, loss_scale, replicas: int):
    """One micro-batch's gradients and loss; the loss is scaled so that summing the gradients over micro-steps and
    replicas gives the mean (they arrive at the all-reduce already divided). `loss_scale`: fp16's LossScale or
    None."""
    import tensorflow as tf

    from trainer.model import causal_lm_loss

    variables = model.trainable_variables
    gradient_scale = 1.0 / (cfg.grad_accum_steps * replicas)

    def micro_step(tokens):
        with tf.GradientTape() as tape:
            loss = causal_lm_loss(model, tokens)
            scaled = loss * gradient_scale
            if loss_scale is not None:
                scaled = loss_scale.scale_loss(scaled)
        gradients = tape.gradient(scaled, variables)
        if loss_scale is not None:
            gradients = loss_scale.unscale(gradients)
        return [tf.convert_to_tensor(g) for g in gradients], loss

    return micro_step


def gradient_function(cfg: RunConfig, model, loss_scale, replicas: int):
    """This replica's gradients and mean loss over its micro-batches (a function to call in the step's graph)."""
    import tensorflow as tf

    variables = model.trainable_variables
    micro_steps = cfg.grad_accum_steps
    micro_step = micro_step_function(cfg, model, loss_scale, replicas)

    def add_micro_steps(micro_batches, count):
        """The first `count` micro-steps' gradients and loss, summed in order."""
        gradients = [tf.zeros_like(v) for v in variables]
        loss_sum = tf.constant(0.0)
        for index in tf.range(count):
            micro_gradients, loss = micro_step(micro_batches[index])
            gradients = [total + g for total, g in zip(gradients, micro_gradients)]
            loss_sum += loss
        return gradients, loss_sum

    if cfg.xla:
        # One compiled cluster for every micro-step: it releases all gradients at once, so nothing overlaps.
        @tf.function(jit_compile=True)
        def local_gradients(micro_batches):
            if micro_steps == 1:
                return micro_step(micro_batches[0])
            gradients, loss_sum = add_micro_steps(micro_batches, micro_steps)
            return gradients, loss_sum / micro_steps
    else:
        def local_gradients(micro_batches):
            # The last micro-step outside any loop and in the step's own graph: its gradients appear layer by
            # layer, and each pack's all-reduce starts as soon as its gradients exist.
            if micro_steps == 1:  # nothing to add up: no zero buffers and no loop
                return micro_step(micro_batches[0])
            gradients, loss_sum = add_micro_steps(micro_batches, micro_steps - 1)
            last_gradients, last_loss = micro_step(micro_batches[micro_steps - 1])
            return [total + g for total, g in zip(gradients, last_gradients)], (loss_sum + last_loss) / micro_steps

    return local_gradients


def adapt_model(cfg: RunConfig, model) -> None:
    """Apply the run's memory settings to a model just built (inside the strategy scope): recomputed blocks, and with
    `adapter` = lora the frozen base (in `base_weights_dtype`) with its adapters (`model.adapters`)."""
    from trainer.lora_plan import plan_for_decoder

    model.recompute = cfg.recompute
    plan = plan_for_decoder(cfg, model.config)
    if plan is None:
        return
    from trainer.lora import attach_lora

    attach_lora(model, plan, seed=cfg.seed, base_dtype=cfg.base_weights_dtype)
    log.info("LoRA: rank %d, alpha %g on %s (%d modules): %d trainable parameters; base frozen in %s",
             plan.rank, plan.alpha, ", ".join(plan.targets), len(plan.modules), plan.parameters,
             cfg.base_weights_dtype)


class TrainState:
    """Model, optimizer and step counter under the strategy, with the compiled step function."""

    def __init__(self, job: TrainJob, strategy, precision, work_dir: Path) -> None:
        import tensorflow as tf

        from trainer.adamw import AdamW
        from trainer.model import Vocabulary, build_model
        from trainer.recipe import clip_gradients, learning_rate_schedule

        cfg = self.cfg = job.cfg
        self.strategy = strategy
        with strategy.scope():
            self.model = build_model(
                cfg.model, Vocabulary.of(job.manifest["tokenizer"]), block_size=cfg.block_size, work_dir=work_dir,
                compute_dtype=precision.compute_dtype.name, seed=cfg.seed, resize_embeddings=cfg.resize_embeddings,
            )
            adapt_model(cfg, self.model)
            self.optimizer = AdamW(self.model.trainable_variables, learning_rate_schedule(cfg),
                                   weight_decay=cfg.weight_decay)
            self.loss_scale = precision.make_loss_scale()
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="train_step")
        scaling = {"loss_scale": self.loss_scale} if self.loss_scale is not None else {}
        # With LoRA the checkpoint holds the adapters alone: the base is the one the run's pinned config names.
        adapters = self.model.adapters
        trained = {"adapters": adapters} if adapters is not None else {"model": self.model}
        self.checkpoint = tf.train.Checkpoint(optimizer=self.optimizer, step=self.step, **trained, **scaling)

        model, optimizer, loss_scale = self.model, self.optimizer, self.loss_scale
        local_gradients = gradient_function(cfg, model, loss_scale, strategy.num_replicas_in_sync)
        self.reducer = reduce_gradients = GradientReducer(cfg)

        def update(gradients):
            gradients, norm = clip_gradients(gradients)
            # The gradients are summed over the workers already: AdamW applies them as they are. A LossScale skips
            # the update on every replica alike when the all-reduced gradients hold an inf or NaN.
            if loss_scale is not None:
                loss_scale.apply_gradients(optimizer, gradients)
            else:
                optimizer.apply_gradients(gradients)
            return norm

        if cfg.xla:
            update = tf.function(update, jit_compile=True)

        def replica_step(micro_batches, stop):
            gradients, loss = local_gradients(micro_batches)
            norm = update(reduce_gradients(gradients))
            # Loss, norm and this worker's stop flag (a preemption notice) travel in one all-reduce.
            return tf.stack([tf.cast(loss, tf.float32), tf.cast(norm, tf.float32), stop])

        @tf.function
        def traced_step(micro_batches, stop):
            # This step's rate, read before apply_gradients advances the count: in the graph, not as eager ops
            # between steps (which cost the tiny model a few percent of its step time).
            learning_rate = optimizer.current_learning_rate()
            figures = strategy.run(replica_step, args=(micro_batches, stop))
            # After the gradients in program order: collectives run in that order, and this would delay them. The
            # mean stop flag is above 0 on every rank as soon as one rank has a notice: all stop at the same step.
            loss, norm, stop_any = tf.unstack(strategy.reduce(tf.distribute.ReduceOp.MEAN, figures, axis=None))
            return loss, norm, learning_rate, stop_any > 0.0

        self._traced_step = traced_step
        self._stop_flags = (tf.constant(0.0), tf.constant(1.0))  # made once: no eager op per step
        self.allreduce: dict[str, Any] | None = None  # what the gradients' all-reduce became, once traced

    def train_step(self, micro_batches, stop: bool = False):
        """One optimizer step: (mean loss, gradient norm, learning rate, whether any rank asked to stop). `stop`:
        this worker has a preemption notice. The first call traces the step and records the packs TF made of the
        gradients' all-reduce."""
        flag = self._stop_flags[int(stop)]
        if self.allreduce is not None:
            return self._traced_step(micro_batches, flag)
        with PackRecorder() as recorder:
            result = self._traced_step(micro_batches, flag)
        variables, cfg = self.model.trainable_variables, self.cfg
        packs = recorder.gradient_packs(len(variables))
        self.allreduce = {"implementation": self.reducer.implementation, "dtype": self.reducer.dtype,
                          "pack_mb": self.reducer.pack_mb, "packs": packs, "overlap": bool(packs and packs > 1)}
        log.info("%s", self.reducer.describe(variables, packs, cfg.xla))
        return result

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
