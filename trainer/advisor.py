"""The scaling advisor: predicted step time, tokens/s, speedup and efficiency for every worker count up to the asked
one, before the run pays for them.

Inputs, all measured on the run's own workers:
- the preflight's all-reduce bus bandwidth and small-message latency between the actual workers;
- the gradient size: the model's trainable parameters x the bytes of their dtype (gradients have the variables'
  dtype; mixed precision keeps float32 variables);
- the single-worker step time of the run's global batch: a few-step probe (`trainer/advisor_probe.py`, one process,
  no collectives) or the matching baseline's summary when it is reused.

The model, per worker count N (step time T, single-worker step time T1, gradient bytes B on the wire):
- compute: each worker does 1/N of the global batch's micro-steps, T1 / N; on the CPU workers on one host share
  its cores, so the busiest host (k of the N workers) runs at 1/k of the probe's speed: T1 x k / N;
- communication: a ring all-reduce of the gradients in `allreduce_dtype` (bfloat16 halves B), 2(N-1)/N x B /
  busbw, plus per-message latency for each collective of a step (every gradient pack, then the loss and gradient
  norm), scaled from the measured ring of N0 workers by the 2(N-1) hops of a ring of N;
- exposed communication: with one pack, all of it (the all-reduce starts after the last micro-step's backward);
  with packs (`allreduce_pack_mb`), TF all-reduces them in reverse variable order as their gradients become ready
  during the last micro-step's backward (2/3 of a micro-step), so what shows is the larger of the last pack (the
  first variables, the embedding among them, are ready only when backward ends) and the communication that the
  backward cannot cover;
- T = compute + exposed communication; the bound if all of it hid: T = max(compute, communication).
Speedup = T1 / T(N), efficiency = speedup / N. The levers (`levers`): the asked count's efficiency with bfloat16
on the wire, with packs, and with a 2x or 4x global batch (more tokens per all-reduce), so the recommendation can
name the one that helps most on the measured network.

This module imports no TensorFlow (the tasks and the preflight's chief use the prediction); the probe
(`trainer/advisor_probe.py`) does, in a child process without TF_CONFIG.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.config import ConfigError

METRIC_COLLECTIVES = 2  # after the gradients' packs: the loss and gradient-norm means
BACKWARD_SHARE = 2 / 3  # of a micro-step: the backward pass costs about twice the forward
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
# The recommendation: the fewest workers reaching this share of the best predicted speedup.
NEAR_BEST_SPEEDUP = 0.9
# A lever is named when it raises the asked count's predicted efficiency by at least this much.
LEVER_GAIN = 0.05
LEVER_PACK_MB = 32  # the pack size a lever proposes when the run sends one pack (Model Garden, DDP: 25-64 MiB)


def ring_seconds(num_workers: int, gradient_bytes: int, busbw_gbps: float, hop_latency_s: float,
                 collectives: int = 1 + METRIC_COLLECTIVES) -> float:
    """One step's collectives on a ring of `num_workers`: bandwidth term 2(N-1)/N x B / busbw, plus latency."""
    if num_workers <= 1:
        return 0.0
    bandwidth = 2 * (num_workers - 1) / num_workers * gradient_bytes / (busbw_gbps * 1e9)
    return bandwidth + collectives * 2 * (num_workers - 1) * hop_latency_s


def pack_sizes(variable_bytes: Sequence[int], pack_bytes: int) -> list[int]:
    """The all-reduce packs TF 2.21 builds from gradients of these sizes (variable order), in the order it sends
    them: the list reversed (the last layers' gradients are ready first), each pack closed once it holds more than
    `pack_bytes` (`cross_device_utils.group_by_size`); 0 = one pack."""
    if pack_bytes <= 0 or not variable_bytes:
        return [sum(variable_bytes)]
    packs: list[int] = []
    for size in reversed(variable_bytes):
        if not packs or packs[-1] > pack_bytes:
            packs.append(0)
        packs[-1] += size
    return packs


def exposed_seconds(num_workers: int, packs: Sequence[int], busbw_gbps: float, hop_latency_s: float,
                    backward_s: float) -> float:
    """Communication that shows in the step time: all of it with one pack; with packs, the larger of the last pack
    (ready only when backward ends) and what `backward_s` of the last micro-step's backward cannot cover."""
    total = ring_seconds(num_workers, sum(packs), busbw_gbps, hop_latency_s, len(packs) + METRIC_COLLECTIVES)
    if len(packs) <= 1:
        return total
    last = ring_seconds(num_workers, packs[-1], busbw_gbps, hop_latency_s, 1 + METRIC_COLLECTIVES)
    return max(last, total - backward_s)


def busiest_host_share(hosts: Sequence[str], count: int) -> int:
    """Workers on the most crowded host when the first `count` ranks run (placement fills ranks in order)."""
    used = list(hosts[:count]) or ["?"]
    return max(used.count(host) for host in set(used))


@dataclass(frozen=True)
class Measured:
    """What the prediction starts from: the asked count, the single-worker step time of the global batch, the
    gradient bytes on the wire, the measured ring's bus bandwidth and small-message latency over `measured_workers`,
    the ranks' hosts in order (`shared_cores`: workers on one host share its CPU cores). `packs`: the gradients'
    all-reduce packs in bytes (empty: one pack of `gradient_bytes`); `micro_steps`: the global batch's micro-batches
    (the last one's backward is what packs overlap)."""

    num_workers: int
    single_step_s: float
    gradient_bytes: int
    busbw_gbps: float
    latency_ms: float
    measured_workers: int
    tokens_per_step: int
    hosts: Sequence[str]
    shared_cores: bool
    packs: Sequence[int] = ()
    micro_steps: int = 1


def predict(measured: Measured) -> dict[str, Any]:
    """The advisor's table for N in 1..num_workers (see the module doc), with the recommendation."""
    m = measured
    if m.single_step_s <= 0 or m.busbw_gbps <= 0:
        raise ValueError(f"the advisor needs a positive step time and bus bandwidth, got {m.single_step_s!r} s and "
                         f"{m.busbw_gbps!r} GB/s")
    packs = list(m.packs) or [m.gradient_bytes]
    # The measured small all-reduce crossed 2(N0-1) ring hops.
    hop_latency_s = m.latency_ms / 1e3 / (2 * (m.measured_workers - 1)) if m.measured_workers > 1 else 0.0
    rows = []
    for count in range(1, m.num_workers + 1):
        crowd = busiest_host_share(m.hosts, count) if m.shared_cores else 1
        compute = m.single_step_s * crowd / count
        backward = BACKWARD_SHARE * m.single_step_s * crowd / m.micro_steps
        communication = ring_seconds(count, sum(packs), m.busbw_gbps, hop_latency_s, len(packs) + METRIC_COLLECTIVES)
        exposed = exposed_seconds(count, packs, m.busbw_gbps, hop_latency_s, backward)
        step = compute + exposed
        overlapped = max(compute, communication)
        speedup = m.single_step_s / step
        rows.append({
            "num_workers": count, "compute_s": compute, "communication_s": communication,
            "exposed_communication_s": exposed, "step_time_s": step,
            "step_time_overlap_s": overlapped, "tokens_per_s": m.tokens_per_step / step,
            "tokens_per_s_overlap": m.tokens_per_step / overlapped, "speedup": speedup,
            "efficiency": speedup / count, "speedup_overlap": m.single_step_s / overlapped,
            "efficiency_overlap": m.single_step_s / overlapped / count, "workers_per_host": crowd,
        })
    return {"rows": rows, "recommended_workers": recommended(rows),
            "recommendation": recommendation(rows, m.num_workers)}


def recommended(rows: Sequence[Mapping[str, Any]]) -> int:
    best = max(row["speedup"] for row in rows)
    return next(row["num_workers"] for row in rows if row["speedup"] >= NEAR_BEST_SPEEDUP * best)


def recommendation(rows: Sequence[Mapping[str, Any]], asked: int) -> str:
    """One sentence: the asked count's predicted efficiency, and the count to use instead when there is one."""
    by_count = {row["num_workers"]: row for row in rows}
    mine, choice = by_count[asked], by_count[recommended(rows)]
    head = f"{asked} workers: predicted {mine['efficiency']:.0%} efficiency ({mine['speedup']:.2f}x)"
    if choice["num_workers"] == asked:
        return head + f"; the best choice up to {asked} workers"
    if choice["num_workers"] == 1:
        return head + "; 1 worker is predicted as fast or faster: more workers add communication (and on a CPU " \
                      "share its cores)"
    return head + f"; {choice['num_workers']} workers reach {choice['speedup']:.2f}x at {choice['efficiency']:.0%}"


def table_lines(advice: Mapping[str, Any]) -> list[str]:
    """The prediction as a small text table for logs and error messages (with the cost columns when priced)."""
    cost = advice.get("cost") or {}
    priced = bool(cost.get("cheapest_workers"))
    lines = [(f"{'workers':>7} {'step ms':>9} {'overlap ms':>10} {'tokens/s':>10} {'speedup':>8} "
              f"{'efficiency':>10} {'eff. overlap':>12}" + (f" {'est. h':>8} {'est. cost':>10} {'per Mtok':>9}"
                                                            if priced else ""))]
    for row in advice["rows"]:
        lines.append(f"{row['num_workers']:>7} {row['step_time_s'] * 1e3:>9.1f} "
                     f"{row['step_time_overlap_s'] * 1e3:>10.1f} {row['tokens_per_s']:>10,.0f} "
                     f"{row['speedup']:>7.2f}x {row['efficiency']:>10.0%} {row['efficiency_overlap']:>12.0%}"
                     + (f" {row['est_hours']:>8.3f} {row['est_cost']:>10.4g} {row['cost_per_mtoken']:>9.4g}"
                        if priced else ""))
    lines.append(f"recommendation: {advice['recommendation']}")
    if priced:
        lines.append(f"cost ({cost['currency']} at {cost['rate']:g}/{cost['unit']}, overhead {cost['overhead_s']:.0f} s"
                     f" per worker from run {cost['overhead_from']}): cheapest {cost['cheapest_workers']} workers; "
                     f"fastest{' within max_run_cost' if cost.get('budget') else ''}: "
                     f"{cost['fastest_workers'] or 'none'}")
    elif cost.get("skipped"):
        lines.append(f"cost: not estimated: {cost['skipped']}")
    return lines


# Idle causes that every launch of a run pays again (tasks/ledger/usage.py): the fixed overhead per worker of a run.
OVERHEAD_CAUSES = ("startup", "stragglers", "preflight", "compile", "evaluation", "export")


def overhead_per_worker_s(usage: Mapping[str, Any]) -> float:
    """An earlier run's fixed overhead per worker slot (seconds) from its report's `usage`."""
    causes = usage.get("idle_by_cause_gpu_h") or {}
    return sum(float(causes.get(cause) or 0.0) for cause in OVERHEAD_CAUSES) * 3600 / max(1, int(usage["slots"]))


def cost_columns(rows: Sequence[dict[str, Any]], *, steps: int, tokens_per_step: int, rate: float,
                 overhead_s: float, budget: float = 0.0) -> dict[str, Any]:
    """Adds `est_hours` (wall), `est_cost` (N x wall x rate) and `cost_per_mtoken` to each row, as `sky bench`'s
    EST(hr) and EST($) predicted: N workers hold their slots for the fixed overhead plus `steps` predicted steps.
    Returns the two picks: cheapest (least cost per token; fewer workers on a tie) and fastest within `budget`
    (0 = no budget: the fastest)."""
    for row in rows:
        wall_s = overhead_s + steps * row["step_time_s"]
        row["est_hours"] = wall_s / 3600
        row["est_cost"] = row["num_workers"] * row["est_hours"] * rate
        row["cost_per_mtoken"] = row["est_cost"] / max(1, steps * tokens_per_step) * 1e6
    cheapest = min(rows, key=lambda row: (round(row["cost_per_mtoken"], 12), row["num_workers"]))
    within = [row for row in rows if not budget or row["est_cost"] <= budget]
    fastest = min(within, key=lambda row: (row["est_hours"], row["num_workers"])) if within else None
    return {"cheapest_workers": cheapest["num_workers"], "fastest_workers": fastest and fastest["num_workers"],
            "budget": budget}


def budget_error(advice: Mapping[str, Any]) -> str | None:
    """The preflight error when the asked count's predicted cost is above `max_run_cost`, else None."""
    cost = advice.get("cost") or {}
    budget = cost.get("budget")
    if not budget or not cost.get("cheapest_workers"):
        return None
    asked = advice["rows"][advice["asked"]["num_workers"] - 1]
    if asked["est_cost"] <= budget:
        return None
    fastest = cost.get("fastest_workers")
    return (f"{asked['num_workers']} workers are predicted to cost {asked['est_cost']:.4g} {cost['currency']} "
            f"({asked['est_hours']:.3f} h each), above 'max_run_cost' = {budget:g}: "
            + (f"{fastest} workers are the fastest within it, {cost['cheapest_workers']} the cheapest; "
               if fastest else "no worker count fits it; ")
            + "lower 'num_workers', or raise 'max_run_cost' (0 = off).\n" + "\n".join(table_lines(advice)))


def wire_packs(step: Mapping[str, Any], wire_dtype: str, pack_mb: float) -> list[int]:
    """The gradients' all-reduce packs in bytes for a step measurement, a wire dtype and a pack size."""
    value_bytes = DTYPE_BYTES[wire_dtype] if wire_dtype == "bfloat16" else DTYPE_BYTES.get(step["gradient_dtype"], 4)
    sizes = [count * value_bytes for count in step.get("variable_parameters") or [step["parameters"]]]
    return pack_sizes(sizes, int(pack_mb * 2**20))


def levers(cfg, measured: Measured, step: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The asked count's predicted efficiency with each setting that changes communication's share, best first:
    bfloat16 on the wire, packs that overlap the backward pass (not with XLA, which releases every gradient at
    once), and a 2x or 4x global batch (more accumulation steps: more tokens per all-reduce). Only those the run's
    config accepts with that setting changed: never one that cannot run (bfloat16 over NCCL, a batch past a limit)."""
    def efficiency(*, wire: str, pack_mb: float, scale: int) -> float:
        rows = predict(dataclasses.replace(
            measured, single_step_s=measured.single_step_s * scale, tokens_per_step=measured.tokens_per_step * scale,
            micro_steps=measured.micro_steps * scale, packs=wire_packs(step, wire, pack_mb)))["rows"]
        return rows[cfg.num_workers - 1]["efficiency"]

    wire, pack_mb = cfg.allreduce_dtype, 0 if cfg.xla else cfg.allreduce_pack_mb
    options = []  # (lever, setting, its new value, the prediction's inputs)
    if wire != "bfloat16":
        options.append(("bfloat16 on the wire", "allreduce_dtype", "bfloat16",
                        {"wire": "bfloat16", "pack_mb": pack_mb, "scale": 1}))
    if not pack_mb and not cfg.xla:
        options.append((f"{LEVER_PACK_MB} MiB packs that overlap the backward pass", "allreduce_pack_mb",
                        LEVER_PACK_MB, {"wire": wire, "pack_mb": LEVER_PACK_MB, "scale": 1}))
    for scale in (2, 4):
        options.append((f"a {scale}x global batch (more tokens per all-reduce)", "grad_accum_steps",
                        cfg.grad_accum_steps * scale, {"wire": wire, "pack_mb": pack_mb, "scale": scale}))
    now = efficiency(wire=wire, pack_mb=pack_mb, scale=1)
    found = [{"lever": name, "setting": setting, "efficiency": efficiency(**settings), "from_efficiency": now}
             for name, setting, value, settings in options if _runs(cfg, setting, value)]
    return sorted(found, key=lambda lever: -lever["efficiency"])


def _runs(cfg, setting: str, value: Any) -> bool:
    """Whether the run's config accepts `setting` = `value` with everything else kept."""
    try:
        cfg.replace(**{setting: value})
    except ConfigError:
        return False
    return True


def lever_sentence(found: Sequence[Mapping[str, Any]]) -> str | None:
    """The lever to name, when one gains at least `LEVER_GAIN`: the communication settings first (they keep the
    training recipe), the smallest larger global batch when neither helps enough."""
    useful = [lever for lever in found if lever["efficiency"] - lever["from_efficiency"] >= LEVER_GAIN]
    keeps_recipe = [lever for lever in useful if lever["setting"] != "grad_accum_steps"]
    batches = sorted((lever for lever in useful if lever["setting"] == "grad_accum_steps"),
                     key=lambda lever: lever["efficiency"])
    best = keeps_recipe[0] if keeps_recipe else batches[0] if batches else None
    if best is None:
        return None
    return (f"{best['lever']} ('{best['setting']}') is predicted to raise efficiency from "
            f"{best['from_efficiency']:.0%} to {best['efficiency']:.0%} on this network")


def advise(*, cfg, collectives: Mapping[str, Any], workers: Sequence[Mapping[str, Any]],
           step: Mapping[str, Any]) -> dict[str, Any]:
    """The prediction for a run from its preflight results and a single-worker step measurement
    (`{"seconds_per_step", "parameters", "variable_parameters", "gradient_dtype", "source"}`)."""
    bandwidth, latency = collectives["bandwidth"], collectives["latency"]
    pack_mb = 0 if cfg.xla else cfg.allreduce_pack_mb  # XLA releases every gradient at once: nothing to overlap
    packs = wire_packs(step, cfg.allreduce_dtype, pack_mb)
    hosts = [report["host"] for report in sorted(workers, key=lambda r: r["rank"])]
    measured = Measured(
        num_workers=cfg.num_workers, single_step_s=step["seconds_per_step"], gradient_bytes=sum(packs),
        busbw_gbps=bandwidth["busbw_gbps"], latency_ms=latency["p50_ms"], measured_workers=len(workers),
        tokens_per_step=cfg.global_batch_size * cfg.block_size, hosts=hosts, shared_cores=not cfg.use_gpu,
        micro_steps=cfg.num_workers * cfg.grad_accum_steps, packs=packs)
    advice = predict(measured)
    found = levers(cfg, measured, step)
    lever = lever_sentence(found)
    if lever:
        advice["recommendation"] += f"; {lever}"
    asked = advice["rows"][cfg.num_workers - 1]
    return {
        "inputs": {"single_step_s": step["seconds_per_step"], "step_source": step["source"],
                   "parameters": step["parameters"], "gradient_dtype": step["gradient_dtype"],
                   "allreduce_dtype": cfg.allreduce_dtype, "allreduce_pack_mb": pack_mb, "packs": len(packs),
                   "gradient_bytes": sum(packs), "busbw_gbps": bandwidth["busbw_gbps"],
                   "latency_p50_ms": latency["p50_ms"], "measured_workers": len(workers), "hosts": hosts,
                   "shared_cores": not cfg.use_gpu, "collectives_per_step": len(packs) + METRIC_COLLECTIVES},
        **advice,
        "levers": found,
        "asked": {"num_workers": cfg.num_workers, "speedup": asked["speedup"], "efficiency": asked["efficiency"]},
        "min_predicted_efficiency": cfg.monitoring.min_predicted_efficiency,
    }


def efficiency_error(advice: Mapping[str, Any]) -> str | None:
    """The preflight error when the asked count is predicted below `min_predicted_efficiency`, else None."""
    limit = advice["min_predicted_efficiency"]
    asked = advice["asked"]
    if not limit or asked["efficiency"] >= limit:
        return None
    return (f"{asked['num_workers']} workers are predicted at {asked['efficiency']:.0%} scaling efficiency, below "
            f"'min_predicted_efficiency' = {limit:g}: lower 'num_workers' to the recommended "
            f"{advice['recommended_workers']}, or lower 'min_predicted_efficiency' (0 = off).\n"
            + "\n".join(table_lines(advice)))


def step_from_summary(summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """A baseline summary's single-worker step time, when it timed steps and names the gradients' size."""
    timed, seconds = summary.get("steps_timed"), summary.get("train_time_s")
    if summary.get("num_workers") != 1 or not timed or not seconds or not summary.get("parameters"):
        return None
    return {"seconds_per_step": seconds / timed, "parameters": summary["parameters"],
            "variable_parameters": summary.get("variable_parameters"),
            "gradient_dtype": summary.get("gradient_dtype", "float32"), "source": "baseline summary"}
