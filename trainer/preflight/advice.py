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

from trainer import advisor, runtime, storage
from trainer.config import RunConfig

log = logging.getLogger("trainer.preflight")

PROBE_COMMAND = (sys.executable, "-m", "trainer.advisor")
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
    return {**advice, "error": advisor.efficiency_error(advice)}


def probe_step(cfg: RunConfig, identity: runtime.WorkerIdentity, *, config_url: str,
               manifest_url: str) -> dict[str, Any]:
    """The probe's step time, or {"error", "skipped"} when it gives none."""
    limit_s = max(cfg.hang_timeout_s - PROBE_MARGIN_S, 1)
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
                      f"finish within {limit_s:g} s (hang_timeout_s={cfg.hang_timeout_s:g} less {PROBE_MARGIN_S} s) "
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
            return {"error": reason if cfg.min_predicted_efficiency else None, "skipped": reason}
        step = storage.read_json(out)
    log.info("advisor probe: %d single-worker steps of the global batch, median %.1f ms (%.1f s in all)",
             step["steps"], step["seconds_per_step"] * 1e3, time.perf_counter() - started)
    return step
