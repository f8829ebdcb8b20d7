"""The scaling advisor's probe: a few single-worker steps of the run's global batch, in a child process without
TF_CONFIG (`python -m trainer.advisor_probe`), whose median step time the advisor (trainer/advisor.py) scales."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from launcher.log_policy import configure_worker_logging

log = logging.getLogger("trainer.advisor_probe")

PROBE_WARMUP_STEPS = 2  # the first traces and compiles the step, the second still warms caches: not timed
PROBE_TIMED_STEPS = 20  # the median of short steps on a shared machine needs a few


def probe_step_time(cfg, manifest_url: str, steps: int = PROBE_TIMED_STEPS) -> dict[str, Any]:
    """Median time of `steps` optimizer steps of the baseline config (1 worker, the same global batch), after
    `PROBE_WARMUP_STEPS` untimed ones; runs without TF_CONFIG (one device)."""
    from trainer.job import plan_job_for
    from trainer.precision import Precision
    from trainer.recipe import set_random_seed
    from trainer.step import TrainState
    from trainer.train import input_dataset, stage_inputs

    single = cfg.baseline_config()
    with tempfile.TemporaryDirectory(prefix="advisor-probe-") as scratch:
        job = plan_job_for(single, "the advisor's one-worker config", manifest_url, str(Path(scratch) / "output"),
                           environ={})
        set_random_seed(cfg.seed)
        import tensorflow as tf

        if not single.use_gpu:
            tf.config.set_visible_devices([], "GPU")
        state = TrainState(job, tf.distribute.get_strategy(), Precision(single.mixed_precision), Path(scratch))
        batches = iter(input_dataset(job, stage_inputs(job), start_step=0))
        times = []
        for index in range(PROBE_WARMUP_STEPS + steps):
            micro_batches = next(batches)
            started = time.perf_counter()
            loss = state.train_step(micro_batches)[0]
            float(loss)  # waits for the step
            if index >= PROBE_WARMUP_STEPS:
                times.append(time.perf_counter() - started)
        variables = state.model.trainable_variables
        return {"seconds_per_step": statistics.median(times), "steps": steps,
                "parameters": int(sum(v.shape.num_elements() for v in variables)),
                "variable_parameters": [int(v.shape.num_elements()) for v in variables],
                "gradient_dtype": variables[0].dtype.name, "source": "probe"}


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.advisor_probe --config URL --manifest URL --out FILE`: the probe, its result as JSON."""
    from core.config.pinned import load_pinned_config

    parser = argparse.ArgumentParser(prog="python -m trainer.advisor_probe", description=probe_step_time.__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    configure_worker_logging(logging.WARNING)
    os.environ.pop("TF_CONFIG", None)
    try:
        result = probe_step_time(load_pinned_config(args.config), args.manifest)
    except Exception as error:  # noqa: BLE001 - the preflight reports a probe that cannot run, and goes on
        log.error("the advisor's probe could not train: %s: %s", type(error).__name__, error)
        return 1
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
