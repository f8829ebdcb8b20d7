"""trainer/preflight/advice.py: a probe that hangs fails the preflight in time, naming the rank, the host and the
setting to change."""

from __future__ import annotations

import sys
import time

from core.config import RunConfig
from trainer.preflight import advice
from trainer.runtime import WorkerIdentity


def test_a_hung_advisor_probe_fails_the_preflight_naming_rank_host_and_setting(monkeypatch, tmp_path):
    monkeypatch.setattr(advice, "PROBE_COMMAND", (sys.executable, "-c", "import time; time.sleep(120)"))
    cfg = RunConfig.of(num_workers=2, storage_root=str(tmp_path), hang_timeout_s=10)
    monkeypatch.setattr(advice, "PROBE_MARGIN_S", cfg.launch.hang_timeout_s - 1)  # a 1 s limit
    chief = WorkerIdentity(0, 2, "host-a", ("127.0.0.1:5000", "127.0.0.1:5001"))
    started = time.monotonic()
    result = advice.advise(cfg, chief, config_url="config.json", manifest_url="manifest.json", baseline_summary=None,
                           collectives={}, reports={})
    assert time.monotonic() - started < 30
    assert result["error"] == result["skipped"]
    assert result["error"].startswith("rank 0 on host-a: the scaling advisor's single-worker probe did not finish "
                                      "within 1 s (hang_timeout_s=10 less 9 s)")
    assert "raise hang_timeout_s" in result["error"]


def test_a_failed_probe_blocks_the_gate_only_when_there_is_one(monkeypatch, tmp_path):
    monkeypatch.setattr(advice, "PROBE_COMMAND", (sys.executable, "-c", "raise SystemExit(4)"))
    chief = WorkerIdentity(0, 2, "host-a", ("127.0.0.1:5000", "127.0.0.1:5001"))
    for gate, error in ((0.0, False), (0.5, True)):
        cfg = RunConfig.of(num_workers=2, storage_root=str(tmp_path), min_predicted_efficiency=gate)
        result = advice.advise(cfg, chief, config_url="c", manifest_url="m", baseline_summary=None, collectives={},
                               reports={})
        assert result["skipped"].startswith("the single-worker probe exited with status 4")
        assert bool(result["error"]) is error
