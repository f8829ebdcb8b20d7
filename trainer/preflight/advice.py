"""The scaling advisor's prediction (trainer/advisor.py) from the measured collectives and one worker's step time:
the reused baseline's, else a few-step probe in a child process without TF_CONFIG (the other ranks have finished,
so on a CPU the probe has the host's cores as the baseline will)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from core import storage
from core.config import RunConfig
from core.config.schema import flat_settings
from trainer import advisor, runtime

log = logging.getLogger("trainer.preflight")

PROBE_COMMAND = (sys.executable, "-m", "trainer.advisor_probe")
# The probe trains silently, and the launcher's hang watchdog ends a group that printed nothing for hang_timeout_s:
# the probe gets that much less this margin, so that the preflight, not the watchdog, says what hung.
PROBE_MARGIN_S = 5


def advise(cfg: RunConfig, identity: runtime.WorkerIdentity, *, config_url: str, manifest_url: str,
           baseline_summary: str | None, collectives: dict[str, Any],
           reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The advice with its gate (`error`: below min_predicted_efficiency, or no step time to predict from)."""
    step = None
    if baseline_summary and storage.exists(baseline_summary):
        step = advisor.step_from_summary(storage.read_json(baseline_summary))
    if step is None:
        step = probe_step(cfg, identity, config_url=config_url, manifest_url=manifest_url)
        if "skipped" in step:  # no step time: the advice is the reason
            return step
    advice = advisor.advise(cfg=cfg, collectives=collectives, workers=[reports[r] for r in sorted(reports)], step=step)
    advice["memory"] = reports[min(reports)].get("memory")  # the forecast per worker (trainer/memory_forecast.py)
    try:
        advice["cost"] = cost_advice(cfg, advice, config_url=config_url, reports=reports)
    except Exception as error:  # noqa: BLE001 - the cost columns are advice; storage trouble here fails nothing
        advice["cost"] = {"skipped": f"could not read the price or the earlier runs: {type(error).__name__}: {error}"}
    if advice["cost"].get("skipped"):
        log.info("advisor: no cost estimate: %s", advice["cost"]["skipped"])
    return {**advice, "error": advisor.efficiency_error(advice) or advisor.budget_error(advice)}


def _gpu_name(reports: dict[int, dict[str, Any]]) -> str | None:
    gpus = ((reports.get(0) or {}).get("devices") or {}).get("gpus") or []
    return gpus[0].get("name") if gpus and isinstance(gpus[0], dict) else None


def last_comparable_usage(cfg: RunConfig, own_run_url: str) -> dict[str, Any] | None:
    """The newest earlier report of this storage root with a GPU-time ledger (`usage`) and the same model, block
    size, backend and device kind: whose fixed overhead the cost columns use."""
    runs_url = storage.join(cfg.storage_root, "runs")
    found = []
    for key in storage.list_dir(runs_url) if storage.exists(runs_url) else ():
        url = storage.join(runs_url, key, "report", "report.json")
        if storage.join(runs_url, key) == own_run_url or not storage.exists(url):
            continue
        report = storage.read_json(url)
        earlier, mine = flat_settings(report.get("config") or {}), cfg.settings()  # earlier: nested, or flat (older)
        same = all(earlier.get(name) == mine[name] for name in ("model", "block_size", "backend", "use_gpu"))
        if same and isinstance(report.get("usage"), dict) and report["usage"].get("slots"):
            found.append(report)
    return max(found, key=lambda report: str(report.get("created_at"))) if found else None


def cost_advice(cfg: RunConfig, advice: dict[str, Any], *, config_url: str,
                reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Estimated hours and cost per worker count at the run's frozen price (prepare's `usage/price.json`), with
    the last comparable run's fixed overhead; {"skipped": why} without a price or such a run."""
    run_url = config_url.rsplit("/", 1)[0]
    price_url = storage.join(run_url, "usage", "price.json")
    price = storage.read_json(price_url).get("price") if storage.exists(price_url) else None
    if not price:
        return {"skipped": "the run has no price (no GPT_FINETUNE_PRICING table when it was prepared)"}
    rate = (price.get("rates") or {}).get(_gpu_name(reports) or "", price.get("default"))
    if rate is None:
        return {"skipped": f"the price table has no default rate for {price['capacity']}"}
    earlier = last_comparable_usage(cfg, run_url)
    if earlier is None:
        return {"skipped": "no earlier run of this model, block size, backend and device kind has a GPU-time ledger "
                           "(runs from before it, or none yet): its fixed overhead is unknown"}
    overhead = advisor.overhead_per_worker_s(earlier["usage"])
    picks = advisor.cost_columns(advice["rows"], steps=cfg.max_steps,
                                 tokens_per_step=cfg.global_batch_size * cfg.block_size, rate=rate,
                                 overhead_s=overhead, budget=cfg.monitoring.max_run_cost)
    return {**picks, "rate": rate, "currency": price["currency"], "unit": price["unit"].replace("_", "-"),
            "overhead_s": overhead, "overhead_from": earlier.get("run_id")}


def probe_step(cfg: RunConfig, identity: runtime.WorkerIdentity, *, config_url: str,
               manifest_url: str) -> dict[str, Any]:
    """The probe's step time, or {"error", "skipped"} when it gives none."""
    limit_s = max(cfg.launch.hang_timeout_s - PROBE_MARGIN_S, 1)
    with tempfile.TemporaryDirectory(prefix="preflight-probe-") as scratch:
        out = os.path.join(scratch, "probe.json")
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        started = time.perf_counter()
        log.info("advisor probe: single-worker steps of the global batch, for at most %g s", limit_s)
        try:
            probe = subprocess.run([*PROBE_COMMAND, "--config", config_url, "--manifest", manifest_url, "--out", out],
                                   env=env, check=False, timeout=limit_s)
        except subprocess.TimeoutExpired:
            reason = (f"rank {identity.rank} on {identity.host}: the scaling advisor's single-worker probe did not "
                      f"finish within {limit_s:g} s (hang_timeout_s={cfg.launch.hang_timeout_s:g} less "
                      f"{PROBE_MARGIN_S} s) "
                      "and was stopped: raise hang_timeout_s if a step of the global batch on one worker "
                      "legitimately takes that long, or let a matching baseline's summary stand in for the probe "
                      "(baseline: auto)")
            log.error("%s", reason)
            return {"error": reason, "skipped": reason}
        if probe.returncode != 0 or not os.path.exists(out):
            reason = (f"the single-worker probe exited with status {probe.returncode} (see above), so there "
                      "is no scaling prediction")
            log.warning("%s", reason)
            # Without a prediction the gate cannot pass: it must not let an unknown efficiency through.
            return {"error": reason if cfg.monitoring.min_predicted_efficiency else None, "skipped": reason}
        step = storage.read_json(out)
    log.info("advisor probe: %d single-worker steps of the global batch, median %.1f ms (%.1f s in all)",
             step["steps"], step["seconds_per_step"] * 1e3, time.perf_counter() - started)
    return step
