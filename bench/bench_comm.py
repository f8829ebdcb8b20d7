"""Gradient communication on a real link: two workers on two hosts with network stacks of their own
(tests/support/netns.py: a namespace each, joined by a bridge, every link limited by `tc ... tbf`), one worker per
core, training a model whose gradients make the link the bottleneck.

For each link rate, side by side in one run:
- the step time of {float32, bfloat16} on the wire x {one pack, packs} (`allreduce_dtype`, `allreduce_pack_mb`);
- the communication-bound step time from the bus bandwidth the preflight measured on that link;
- the advisor's predicted step time for each cell (trainer/advisor.py, from that measurement and the one-worker step).

Targets: bfloat16 >= 1.7x faster than float32 where the link dominates (the slow link, 4 sequences per worker, one
pack); packs hide >= 50% of the backward pass where compute and communication are comparable (the fast link with 16
sequences per worker, bfloat16: the step time packs save over the last micro-step's backward time; above 100%, the
smaller messages also cost gRPC less than one large one); the advisor within 25% of the measured step time in every
cell. Needs root and iproute2 (`make provision`); rates stay well below this
machine's ~1.9 Gbit/s gRPC ceiling (../shared/research/comm_perf.md).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer import advisor

# Per link rate, the batch per worker: on the slow link the link dominates; on the fast one a 4x batch makes compute
# comparable to communication, where overlap matters.
BATCH_BY_RATE = {100: 4, 400: 16}
RATES_MBIT = tuple(BATCH_BY_RATE)
PACK_MB = 1.0
CELLS = (("float32", 0.0), ("float32", PACK_MB), ("bfloat16", 0.0), ("bfloat16", PACK_MB))
STEPS = 24
WARMUP_STEPS = 4  # tracing, the first packs' buffers: not timed
# 3.2M parameters (12.8 MB of float32 gradients) in four layers of 256, a 320-token vocabulary: most bytes are in
# the layers, not the embedding that the last pack carries, so packs have something to overlap.
MODEL_SHAPE = {"n_layer": 4, "n_head": 4, "n_embd": 256, "n_positions": 64}
TRAIN = {"tokenizer": "bpe:320", "block_size": 32, "max_steps": STEPS,
         "warmup_steps": 2, "learning_rate": 1e-3, "checkpoint_every_steps": STEPS, "baseline": "skip"}
BF16_SPEEDUP_TARGET = 1.7
HIDDEN_TARGET = 0.5
ADVISOR_ERROR_TARGET = 0.25
REPO = Path(__file__).resolve().parents[1]


def _environment() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", "TF_USE_LEGACY_KERAS": "1",
           # One core each: one compute thread, and a second inter-op thread so a pack's all-reduce can run while
           # the backward pass goes on.
           "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}
    env.pop("TF_CONFIG", None)
    return env


def _model_dir(root: Path) -> str:
    """A save_pretrained directory of MODEL_SHAPE, random weights (the trainer loads it as it would a real one)."""
    code = ("import sys; from transformers import GPT2Config, TFGPT2LMHeadModel; "
            f"m = TFGPT2LMHeadModel(GPT2Config(vocab_size=320, **{MODEL_SHAPE!r})); m.build_in_name_scope(); "
            "m.save_pretrained(sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(root / "model")], env=_environment(), check=True,
                   capture_output=True)
    return str(root / "model")


def _config(root: Path, name: str, **settings) -> Path:
    path = root / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**TRAIN, "storage_root": str(root / "storage"), **settings}))
    return path


def _median_step_s(output: Path) -> float:
    lines = (output / "metrics" / "rank-0.jsonl").read_text().splitlines()
    times = [json.loads(line)["step_time_s"] for line in lines]
    return statistics.median(times[WARMUP_STEPS:])


def _single_worker(root: Path, model: str, manifest: str, batch: int) -> dict:
    """The one-worker step of the same global batch (two micro-batches), pinned to one core: the advisor's input."""
    config = _config(root, f"single-{batch}", model=model, num_workers=1, grad_accum_steps=2,
                     batch_size_per_worker=batch)
    output = root / f"single-{batch}" / "output"
    subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "trainer.train", "--config", str(config),
                    "--manifest", manifest, "--output", str(output)], env=_environment(), check=True,
                   capture_output=True, timeout=600)
    # As the preflight reads a reused baseline's summary: the advisor is checked on the inputs it gets in a run.
    summary = output / "summary.json"
    return {**advisor.step_from_summary(json.loads(summary.read_text())), "summary": str(summary)}


def _pair(network, root: Path, name: str, entrypoint: str, args: list[str], port: int) -> None:
    """Run `entrypoint` as rank 0 and 1 on the two namespaced hosts (one core each) until both exit."""
    addresses = [f"{host.address}:{port}" for host in network.hosts]
    processes = []
    for rank, host in enumerate(network.hosts):
        env = {**_environment(), "TF_CONFIG": json.dumps({"cluster": {"worker": addresses},
                                                          "task": {"type": "worker", "index": rank}})}
        log = (root / f"{name}-rank-{rank}.log").open("wb")
        processes.append(subprocess.Popen(host.command(["taskset", "-c", str(rank), sys.executable, "-m",
                                                        entrypoint, *args]),
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [process.wait(timeout=900) for process in processes]
    if codes != [0, 0]:
        tail = (root / f"{name}-rank-0.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name}: the workers exited with {codes}; rank 0's log ends:\n{tail}")


def _measure_link(network, root: Path, model: str, manifest: str, rate: int, step: dict) -> dict:
    """The preflight's collectives on this link: bus bandwidth and small-message latency."""
    config = _config(root, f"preflight-{rate}", model=model, num_workers=2, batch_size_per_worker=BATCH_BY_RATE[rate])
    output = root / f"preflight-{rate}" / "report"
    _pair(network, root, f"preflight-{rate}", "trainer.preflight",
          ["--config", str(config), "--manifest", manifest, "--output", str(output),
           "--baseline-summary", step["summary"]], port=21000 + rate)
    return json.loads((output / "preflight.json").read_text())["collectives"]


def run(out_dir: Path) -> dict:
    from core.config import RunConfig
    from tests.support import netns
    from tests.trainer.shards import write_dataset

    reason = netns.unavailable_reason() or (None if shutil.which("taskset") else "taskset is not installed")
    if reason:
        raise RuntimeError(f"no namespaced hosts: {reason}")
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-comm-") as tmp:
        root = Path(tmp)
        manifest = write_dataset(root / "dataset", sorted((REPO / "data" / "sample").glob("*.txt")), block_size=32,
                                 vocab_size=320, num_train_shards=4, max_chars=200_000)
        model = _model_dir(root)
        steps = {batch: _single_worker(root, model, manifest, batch) for batch in sorted(set(BATCH_BY_RATE.values()))}
        for batch, step in steps.items():
            print(f"one worker, one core: {step['seconds_per_step'] * 1e3:.0f} ms per step of {2 * batch} sequences "
                  f"(2 micro-batches of {batch}: the 2-worker runs' global batch); {step['parameters'] / 1e6:.1f}M "
                  "parameters", flush=True)
        for rate in RATES_MBIT:
            step = steps[BATCH_BY_RATE[rate]]
            with netns.HostNetwork(2, rate_mbit=rate) as network:
                collectives = _measure_link(network, root, model, manifest, rate, step)
                busbw = collectives["bandwidth"]["busbw_gbps"]
                print(f"link {rate} Mbit/s: preflight bus bandwidth {busbw * 8e3:.0f} Mbit/s, "
                      f"latency p50 {collectives['latency']['p50_ms']:.2f} ms", flush=True)
                for index, (dtype, pack_mb) in enumerate(CELLS):
                    name = f"{rate}-{dtype}-{pack_mb:g}"
                    settings = {"model": model, "num_workers": 2, "allreduce_dtype": dtype,
                                "allreduce_pack_mb": pack_mb, "batch_size_per_worker": BATCH_BY_RATE[rate]}
                    config = _config(root, name, **settings)
                    output = root / name / "output"
                    _pair(network, root, name, "trainer.train",
                          ["--config", str(config), "--manifest", manifest, "--output", str(output)],
                          port=22000 + rate * 10 + index)
                    measured = _median_step_s(output)
                    cfg = RunConfig.from_saved({**TRAIN, **settings, "storage_root": str(root)})
                    advice = advisor.advise(cfg=cfg, collectives=collectives, step=step,
                                            workers=[{"rank": r, "host": h.address}
                                                     for r, h in enumerate(network.hosts)])
                    predicted = advice["rows"][1]["step_time_s"]
                    wire_bytes = advice["inputs"]["gradient_bytes"]
                    comm_bound = wire_bytes / (busbw * 1e9)  # 2(N-1)/N = 1 for two workers
                    packs = json.loads((output / "summary.json").read_text())["allreduce"]["packs"]
                    cells.append({"rate_mbit": rate, "batch": BATCH_BY_RATE[rate], "dtype": dtype,
                                  "pack_mb": pack_mb, "packs": packs, "single_step_s": step["seconds_per_step"],
                                  "step_s": measured, "predicted_s": predicted, "comm_bound_s": comm_bound,
                                  "advisor_error": abs(predicted - measured) / measured})
                    print(f"  {dtype:>8} {'packs of ' + format(pack_mb, 'g') + ' MiB' if pack_mb else 'one pack':>16}"
                          f" ({packs} packs): {measured * 1e3:7.0f} ms per step; communication-bound "
                          f"{comm_bound * 1e3:5.0f} ms; advisor {predicted * 1e3:6.0f} ms "
                          f"({cells[-1]['advisor_error']:.0%} off)", flush=True)
    return _verdict(cells)


def _verdict(cells: list[dict]) -> dict:
    def cell(rate: int, dtype: str, pack_mb: float) -> dict:
        return next(c for c in cells if (c["rate_mbit"], c["dtype"], c["pack_mb"]) == (rate, dtype, pack_mb))

    slow, fast = min(RATES_MBIT), max(RATES_MBIT)
    bf16_speedup = cell(slow, "float32", 0.0)["step_s"] / cell(slow, "bfloat16", 0.0)["step_s"]
    # The backward pass of the last (here the only) micro-step on one worker: 2/3 of a micro-step, which is half
    # the one-worker step of two micro-batches.
    one_pack, packed = cell(fast, "bfloat16", 0.0), cell(fast, "bfloat16", PACK_MB)
    backward_s = advisor.BACKWARD_SHARE * one_pack["single_step_s"] / 2
    hidden = (one_pack["step_s"] - packed["step_s"]) / backward_s
    worst_advisor = max(c["advisor_error"] for c in cells)
    rows = [{"benchmark": f"comm: bfloat16 vs float32 on the wire, 2 hosts on a {slow} Mbit/s link, one pack",
             "measured": f"{bf16_speedup:.2f}x", "target": f">= {BF16_SPEEDUP_TARGET}x"},
            {"benchmark": f"comm: step time {PACK_MB:g} MiB packs save, over the last backward pass, bfloat16, {fast} "
                          f"Mbit/s, batch {BATCH_BY_RATE[fast]} per worker (compute ~ communication)",
             "measured": f"{hidden:.0%} ({(one_pack['step_s'] - packed['step_s']) * 1e3:.0f} of "
                         f"{backward_s * 1e3:.0f} ms)", "target": f">= {HIDDEN_TARGET:.0%}"},
            {"benchmark": "comm: advisor's predicted vs measured step time, worst of "
                          f"{len(cells)} cells ({'/'.join(map(str, RATES_MBIT))} Mbit/s x wire dtype x packs)",
             "measured": f"{worst_advisor:.0%} off", "target": f"<= {ADVISOR_ERROR_TARGET:.0%}"}]
    rows += [{"benchmark": f"comm: step time, {c['rate_mbit']} Mbit/s, batch {c['batch']}, {c['dtype']}, "
                           + (f"{c['pack_mb']:g} MiB packs ({c['packs']})" if c["pack_mb"] else "one pack"),
              "measured": f"{c['step_s'] * 1e3:.0f} ms (link-bound {c['comm_bound_s'] * 1e3:.0f} ms, advisor "
                          f"{c['predicted_s'] * 1e3:.0f} ms)", "target": "reported"} for c in cells]
    figures = {
        "rows": rows, "cells": cells, "backward_s_fast_link": backward_s, "bf16_speedup_slow_link": bf16_speedup,
        "backward_hidden_fast_link": hidden,
        "advisor_worst_error": worst_advisor,
        "targets": {"bf16_speedup": BF16_SPEEDUP_TARGET, "backward_hidden": HIDDEN_TARGET,
                    "advisor_error": ADVISOR_ERROR_TARGET},
    }
    for label, value, target, ok in (
            (f"bfloat16 vs float32 on {slow} Mbit/s", f"{bf16_speedup:.2f}x", f">= {BF16_SPEEDUP_TARGET}x",
             bf16_speedup >= BF16_SPEEDUP_TARGET),
            (f"backward pass hidden by packs on {fast} Mbit/s", f"{hidden:.0%}", f">= {HIDDEN_TARGET:.0%}",
             hidden >= HIDDEN_TARGET),
            ("advisor, worst cell", f"{worst_advisor:.0%} off", f"<= {ADVISOR_ERROR_TARGET:.0%}",
             worst_advisor <= ADVISOR_ERROR_TARGET)):
        print(f"{label}: {value} (target {target}) {'met' if ok else 'MISSED'}")
    return figures
