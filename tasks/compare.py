"""The evaluate task: both final models on the same validation shards, then speedup, efficiency and loss parity.

Evaluation runs `python -m trainer.evaluate` as a one-worker group through the launcher, on the run's backend
(a local process, an SSH host), so TensorFlow never loads into the Airflow task runner and release ends it like any
worker. The report is written whatever the outcome of the gates; a failed gate then fails the task with the
numbers in the message.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from tasks import registry, telemetry, throughput
from tasks import report as reports
from tasks.alerts import alert_throughput
from tasks.baseline import read_key_record
from tasks.connections import uses_run_storage
from tasks.formatting import nats
from trainer.config import RunConfig
from trainer.data import tokenizer_url
from trainer.layout import PreflightOutput, StorageLayout, TrainOutput
from trainer.storage import exists, join, read_bytes, read_json, remove_tree

if TYPE_CHECKING:
    from launcher.backend import BackendFactory

log = logging.getLogger("gpt_finetune.compare")

EVALUATE_MODULE = "trainer.evaluate"  # the worker entry point of docs/CONTRACTS.md
BASELINE_EVAL = "eval.json"  # cached next to a baseline: its key covers the data and the evaluation code


class GateFailure(RuntimeError):
    """The distributed model or run failed a comparison gate; the report was still written."""


class EvaluationError(RuntimeError):
    """`trainer.evaluate` exited with an error or wrote no result."""


@uses_run_storage
def evaluate_run(prepared: dict, make_backend: BackendFactory) -> dict:
    """The evaluate task; `make_backend` builds the run's backend for each evaluation (the DAG task hands in
    `tf_multiworker.backends.make_backend`)."""
    cfg = RunConfig.from_saved(prepared["config"])
    return _evaluate(prepared, cfg, make_backend)


def _evaluate(prepared: dict, cfg: RunConfig, make_backend: BackendFactory) -> dict:
    distributed = TrainOutput(prepared["train_url"])
    baseline = None if cfg.baseline == "skip" else TrainOutput(prepared["baseline_url"])
    # Fail fast, before any model loads, when a training job left no summary (it did not complete).
    distributed_summary = _read_summary(distributed, "train")
    baseline_summary = _read_summary(baseline, "baseline") if baseline else None

    report_url = prepared["report_url"]
    for stale in (reports.REPORT_JSON, reports.REPORT_MD, reports.LOSS_CHART, reports.SCALING_CHART):
        remove_tree(join(report_url, stale))  # an earlier attempt's report must not pass for this one's
    distributed_eval = run_evaluation(distributed.model, prepared["manifest_url"],
                                      join(report_url, "eval-distributed.json"), cfg=cfg,
                                      run_key=prepared["run_key"], label="distributed",
                                      make_backend=make_backend)
    baseline_eval = None
    if baseline:
        cached = join(baseline.url, BASELINE_EVAL)
        if exists(cached):
            log.info("Baseline evaluation reused from %s (same baseline key: same data and code).", cached)
            baseline_eval = read_json(cached)
        else:
            baseline_eval = run_evaluation(baseline.model, prepared["manifest_url"], cached, cfg=cfg,
                                           run_key=prepared["run_key"], label="baseline",
                                           make_backend=make_backend)

    promoted = evaluate_promoted(prepared, cfg, make_backend)

    report = build_report(
        prepared, cfg,
        distributed=run_figures("distributed", distributed, distributed_summary, distributed_eval),
        baseline=run_figures("baseline", baseline, baseline_summary, baseline_eval) if baseline else None,
    )
    add_scaling(report, prepared, distributed)
    report["continued_from"] = prepared.get("continued_from")
    report["promoted"] = promoted
    evaluations = {"baseline": baseline_eval, "distributed": distributed_eval}
    if promoted:
        evaluations[f"promoted {promoted['version']}"] = promoted
    report["samples"] = samples_by_model(evaluations)
    earlier = reports.earlier_reports(StorageLayout(prepared["storage_root"]).runs, exclude_run_key=prepared["run_key"])
    expected = throughput.assess(report, earlier, cfg.min_throughput_ratio)
    report["warnings"] = expected.warnings
    trained = [run for run in (report["runs"]["baseline"], report["runs"]["distributed"]) if run]
    charts = {
        reports.LOSS_CHART: reports.loss_chart(
            {run["label"]: read_metrics(TrainOutput(run["output_url"])) for run in trained},
            title=f"Training loss and final eval loss, global batch {cfg.global_batch_size}",
            eval_points={run["label"]: (run["tokens_seen"], run["eval_loss"]) for run in trained},
        ),
        reports.SCALING_CHART: reports.scaling_chart(
            [point for other in earlier for point in reports.history_point(other)] + reports.history_point(report),
            current_run_id=prepared["run_id"],
            predicted=(report.get("prediction") or {}).get("rows"),
        ),
    }
    report_json_url = reports.write_report(report_url, report, charts)
    log.info("Report written to %s\n%s\n%s", report_url, reports.text_table(report["table"]),
             f"Hardware: {report['hardware']['line']}")

    telemetry.emit_report_metrics(report, expected.ratio)
    for warning in report["warnings"]:
        log.warning("Throughput: %s", warning)
    if report["warnings"]:
        telemetry.count("throughput_warning", {"run": prepared["run_key"], "task": "evaluate"})
        alert_throughput(cfg, prepared["run_id"], report["warnings"])
    failed = [gate for gate in report["gates"] if not gate["passed"]]
    if failed:
        raise GateFailure(
            f"{len(failed)} comparison gate(s) failed for run {prepared['run_id']} (report: {report_json_url}): "
            + "; ".join(gate["detail"] for gate in failed)
        )
    comparison = report["comparison"]
    return {
        "report_url": report_json_url,
        "report_md_url": join(report_url, reports.REPORT_MD),
        "speedup": comparison["speedup"],
        "efficiency": comparison["efficiency"],
        "eval_loss": report["runs"]["distributed"]["eval_loss"],
        "baseline_eval_loss": baseline_eval["eval_loss"] if baseline_eval else None,
        "gates_passed": True,
    }


# ---------------------------------------------------------------------------------------------------------------
# inputs


def _read_summary(output: TrainOutput, task_id: str) -> dict[str, Any]:
    if not exists(output.summary):
        raise FileNotFoundError(
            f"{output.summary} does not exist: the '{task_id}' task did not complete, so there is nothing to "
            f"compare. Check that task's log; for the baseline, trigger with baseline='run' to train it afresh."
        )
    return read_json(output.summary)


def read_metrics(output: TrainOutput, rank: int = 0) -> list[dict[str, Any]]:
    """The chief's metrics lines (the loss it logs is the global batch's); empty when it wrote none."""
    url = output.metrics_file(rank)
    if not exists(url):
        log.warning("No metrics at %s: the loss chart will lack this run.", url)
        return []
    return [json.loads(line) for line in read_bytes(url).decode("utf-8").splitlines() if line.strip()]


def run_evaluation(model_url: str, manifest_url: str, output_url: str, *, cfg: RunConfig, run_key: str,
                   label: str, make_backend: BackendFactory) -> dict[str, Any]:
    """`python -m trainer.evaluate` as a one-worker group on the run's backend; its output streams to this log.

    The same launch path as training (tasks/launch.py): the run's marker (release finds it), a state record and the
    rank's log in the run's storage (`evaluate-<label>`), storage credentials as secrets only, one GPU with
    `use_gpu` (none otherwise), the start-up and hang bounds of the run. Returns its result."""
    from launcher import GroupSpec
    from tasks.connections import storage_env
    from tasks.launch import RecordedLaunch

    spec = GroupSpec(
        name=f"evaluate-{label}", entrypoint=EVALUATE_MODULE, num_workers=1, use_gpu=cfg.use_gpu, run_key=run_key,
        args=("--model", model_url, "--manifest", manifest_url, "--output", output_url),
        secret_env=storage_env(cfg.storage_conn_id), startup_timeout_s=cfg.startup_timeout_s,
        hang_timeout_s=cfg.hang_timeout_s,
    )
    remove_tree(output_url)  # a result left by an earlier attempt must not pass for this one
    log.info("Evaluating %s on backend %s", model_url, cfg.backend)
    backend = make_backend(cfg.backend, cfg.to_dict())
    try:
        result = RecordedLaunch(spec, backend, StorageLayout(cfg.storage_root).run(run_key),
                                on_line=lambda rank, line: log.info("[evaluate %s] %s", label, line)).run_group()
    finally:
        backend.close()
    if not result.succeeded:
        raise EvaluationError(f"evaluating {model_url} failed: {result.error_message()}")
    if not exists(output_url):
        raise EvaluationError(f"{EVALUATE_MODULE} exited 0 but wrote no result at {output_url} (model {model_url}).")
    evaluation = read_json(output_url)
    log.info("Evaluated %s in %.1f s: eval loss %.4f, perplexity %.2f", model_url, result.wall_time_s,
             evaluation["eval_loss"], evaluation["perplexity"])
    return evaluation


def add_scaling(report: dict[str, Any], prepared: dict, distributed: TrainOutput) -> None:
    """The train task's segments (elastic recovery) and the advisor's prediction next to the measured figures."""
    from tasks import scaling

    run = report["runs"]["distributed"]
    report["segments"] = scaling.segments(scaling.read_segments(distributed), read_metrics(distributed), run["steps"])
    report["elastic"] = scaling.is_elastic(report["segments"], report["num_workers"])
    preflight = PreflightOutput(prepared["preflight_url"]).result
    report["prediction"] = scaling.prediction(read_json(preflight) if exists(preflight) else None,
                                              run["num_workers"], report["comparison"])
    for row in report["segments"] if report["elastic"] else ():
        log.info("segment: steps %d-%d on %d workers x %d accumulation: %s", row["from_step"] + 1, row["to_step"],
                 row["num_workers"], row["grad_accum_steps"], row["line"])


def evaluate_promoted(prepared: dict, cfg: RunConfig, make_backend: BackendFactory) -> dict[str, Any] | None:
    """The latest promoted version of `model_name`, scored on this run's validation shards (the promotion rule's
    reference and its samples) when its tokenizer is this run's; None when nothing is promoted yet or the run
    is never to be promoted (`promote` = never: nothing to compare with)."""
    pointer = registry.read_latest(registry.model_layout(cfg.storage_root, cfg.model_name))
    if pointer is None or cfg.promote == "never":
        return None
    section = {"name": cfg.model_name, "version": pointer["version"], "url": pointer["url"],
               "run_id": pointer["run_id"], "recorded_eval_loss": pointer["eval_loss"],
               "eval_loss": None, "perplexity": None, "nats_per_char": None, "known_words": None, "samples": None,
               "note": None}
    manifest_url = prepared["manifest_url"]
    if not registry.same_tokenizer(pointer["model_url"], tokenizer_url(manifest_url, read_json(manifest_url))):
        section["note"] = f"{pointer['version']}'s tokenizer differs from this run's: it cannot be scored on its shards"
        log.warning("Promoted %s %s not evaluated: %s.", cfg.model_name, pointer["version"], section["note"])
        return section
    result = run_evaluation(pointer["model_url"], manifest_url, join(prepared["report_url"], "eval-promoted.json"),
                            cfg=cfg, run_key=prepared["run_key"], label="promoted",
                            make_backend=make_backend)
    section.update(eval_loss=result["eval_loss"], perplexity=result["perplexity"], samples=result.get("samples"),
                   nats_per_char=result.get("nats_per_char"), known_words=result.get("known_words"))
    return section


def samples_by_model(evaluations: dict[str, dict[str, Any] | None]) -> list[dict[str, Any]]:
    """[{"model": label, "eval_loss", "nats_per_char", "known_words", "samples": [{"prompt", "greedy", "top_k"}]}]
    for every evaluation that generated some."""
    section = []
    for label, evaluation in evaluations.items():
        samples = (evaluation or {}).get("samples")
        if isinstance(samples, list) and samples and all(isinstance(sample, dict) for sample in samples):
            section.append({"model": label, "eval_loss": evaluation.get("eval_loss"),
                            "nats_per_char": evaluation.get("nats_per_char"),
                            "known_words": evaluation.get("known_words"), "samples": samples})
    return section


# ---------------------------------------------------------------------------------------------------------------
# figures


def run_figures(label: str, output: TrainOutput, summary: dict[str, Any], evaluation: dict[str, Any]) -> dict:
    """The figures of one trained model, from its summary.json and its evaluation result."""
    return {
        "label": label,
        "num_workers": summary["num_workers"],
        "global_batch_size": summary["global_batch_size"],
        "steps": summary["steps"],
        "tokens_seen": summary["tokens_seen"],
        "train_time_s": summary["train_time_s"],
        "seconds_per_step": seconds_per_step(summary),
        "wall_time_s": summary["wall_time_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "final_loss": summary["final_loss"],
        "mfu": summary.get("mfu"),
        "gpu_mem_peak_mb": summary.get("gpu_mem_peak_mb"),  # rank 0's; null on CPU and in older summaries
        "gpu_mem_reserved_mb": summary.get("gpu_mem_reserved_mb"),
        "eval_loss": evaluation["eval_loss"],
        "perplexity": evaluation["perplexity"],
        "nats_per_char": evaluation.get("nats_per_char"),  # absent from a baseline evaluation cached before them
        "known_words": evaluation.get("known_words"),
        "eval_tokens": evaluation["eval_tokens"],
        "eval_time_s": evaluation["eval_time_s"],
        "output_url": output.url,
        "model_url": output.model,
        "summary_url": output.summary,
        "started_at": summary.get("started_at"),
        "finished_at": summary.get("finished_at"),
        "resumed_from_step": summary.get("resumed_from_step"),
        "hardware": summary.get("hardware", {}),
        "versions": summary.get("versions", {}),
        "allreduce": summary.get("allreduce"),  # how its gradients crossed the network (trainer/allreduce.py)
    }


def seconds_per_step(summary: dict[str, Any]) -> float | None:
    """Training seconds per timed step; None when the job timed no step (it resumed at its last step)."""
    timed = summary.get("steps_timed", summary["steps"] - (summary.get("resumed_from_step") or 0))
    return summary["train_time_s"] / timed if timed and summary["train_time_s"] > 0 else None


def compare(distributed: dict[str, Any], baseline: dict[str, Any] | None, tolerance: float) -> dict[str, Any]:
    """speedup = T1/TN, efficiency = speedup/N, delta = lossN - loss1.

    T is the training time per optimizer step (no start-up, no compiling first step): with equal steps it is the
    ratio of the train times, and it stays right when a job resumed from a checkpoint and timed fewer steps.
    """
    if baseline is None:
        return {"speedup": None, "efficiency": None, "loss_delta": None, "loss_tolerance": tolerance}
    timed = baseline["seconds_per_step"] is not None and distributed["seconds_per_step"]
    speedup = baseline["seconds_per_step"] / distributed["seconds_per_step"] if timed else None
    return {
        "speedup": speedup,
        "efficiency": speedup / distributed["num_workers"] if speedup is not None else None,
        "loss_delta": distributed["eval_loss"] - baseline["eval_loss"],
        "loss_tolerance": tolerance,
    }


def gates(distributed: dict[str, Any], baseline: dict[str, Any] | None, comparison: dict[str, Any]) -> list[dict]:
    """Each gate: name, passed, value, limit and a sentence with the numbers (used in the failure message)."""
    finite = math.isfinite(distributed["eval_loss"])
    result = [_gate("eval_loss_finite", finite, distributed["eval_loss"], None,
                    f"distributed eval loss is {distributed['eval_loss']:.4f}"
                    + ("" if finite else ": training diverged; lower 'learning_rate' or enable warmup"))]
    if baseline is None:
        return result
    same_work = (baseline["steps"], baseline["global_batch_size"]) == (distributed["steps"],
                                                                       distributed["global_batch_size"])
    result.append(_gate(
        "same_work", same_work, None, None,
        f"baseline trained {baseline['steps']} steps of {baseline['global_batch_size']} sequences, distributed "
        f"{distributed['steps']} of {distributed['global_batch_size']}"
        + ("" if same_work else ": the comparison is void; trigger with baseline='run'"),
    ))
    delta, tolerance = comparison["loss_delta"], comparison["loss_tolerance"]
    parity = math.isfinite(delta) and abs(delta) <= tolerance
    result.append(_gate(
        "loss_parity", parity, delta, tolerance,
        f"eval loss distributed {distributed['eval_loss']:.4f} - baseline {baseline['eval_loss']:.4f} = "
        f"{nats(delta)} nats, tolerance ±{tolerance:.4f}"
        + ("" if parity else " (setting 'loss_tolerance')"),
    ))
    return result


def _gate(name: str, passed: bool, value: float | None, limit: float | None, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "value": value, "limit": limit, "detail": detail}


def hardware_line(cfg: RunConfig, distributed: dict[str, Any]) -> str:
    """One honest sentence on what bounds the scaling of this run."""
    hardware = distributed.get("hardware") or {}
    workers = cfg.num_workers
    if cfg.use_gpu:
        return (f"{workers} workers x 1 GPU ({hardware.get('gpu') or 'GPU'}), chief on {hardware.get('host')}; "
                f"the baseline trained on 1 GPU of the same kind.")
    cores = hardware.get("cpu_count") or os.cpu_count() or 1
    cpu = f" ({hardware['cpu']})" if hardware.get("cpu") else ""
    if workers == 1:
        return f"1 worker on a {cores}-core CPU{cpu}."
    return (
        f"{workers} workers on a {cores}-core CPU: efficiency is bounded by cores. The 1-worker baseline already "
        f"kept all {cores} cores busy, so the {workers} workers split the same cores: expect a speedup near 1x at "
        f"best and efficiency near 1/N = {1 / workers:.0%}, less the cost of the gradient all-reduce. CPU{cpu}."
    )


def build_report(prepared: dict, cfg: RunConfig, *, distributed: dict[str, Any],
                 baseline: dict[str, Any] | None) -> dict[str, Any]:
    comparison = compare(distributed, baseline, cfg.loss_tolerance)
    checked = gates(distributed, baseline, comparison)
    record = read_key_record(prepared["baseline_url"]) if baseline else None
    trained_by = record["trained_by_run"] if record else None
    report = {
        "format_version": reports.REPORT_FORMAT_VERSION,
        "run_id": prepared["run_id"],
        "run_key": prepared["run_key"],
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "num_workers": cfg.num_workers,
        "gates_passed": all(gate["passed"] for gate in checked),
        "runs": {"distributed": distributed, "baseline": baseline},
        "comparison": comparison,
        "gates": checked,
        "baseline": {
            "policy": cfg.baseline,
            "key": prepared["baseline_key"] if baseline else None,
            "url": prepared["baseline_url"] if baseline else None,
            "trained_by_run": trained_by,
            "reused": bool(baseline) and trained_by != prepared["run_id"],
        },
        "hardware": {
            "line": hardware_line(cfg, distributed),
            "distributed": distributed["hardware"],
            "baseline": baseline["hardware"] if baseline else None,
            "task_host": {"host": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
        },
        "versions": distributed["versions"],
        "config": cfg.to_dict(),
        "dataset_fingerprint": prepared["dataset_fingerprint"],
        "charts": {"loss_curves": reports.LOSS_CHART, "scaling": reports.SCALING_CHART},
    }
    report["table"] = reports.table_rows(report)
    return report
