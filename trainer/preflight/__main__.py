"""Preflight: every worker checks itself, then the group runs collectives with known answers and measures them.

    python -m trainer.preflight --config URL --manifest URL --output REPORT_DIR_URL [--baseline-summary URL]

The steps are described in trainer/preflight/__init__.py; this is the worker's entry point.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from typing import Any

from core import storage
from core.clock import utc_now
from core.config import RunConfig
from core.config.pinned import ConfigChangedError, load_pinned_config
from core.layout import PreflightOutput
from core.protocol import EXIT_PERMANENT
from launcher.log_policy import configure_worker_logging
from trainer import runtime
from trainer.metrics import print_live_line
from trainer.preflight.advice import advise
from trainer.preflight.checks import check_worker
from trainer.preflight.collectives import REPORT_FILE, collectives_main, run_collective_phase
from trainer.preflight.verdict import (
    EXIT_CHECKS_FAILED,
    EXIT_COLLECTIVES_FAILED,
    collective_failure_message,
    group_id,
    live_values,
    read_rank_reports,
    summary_lines,
    version_skew,
)

log = logging.getLogger("trainer.preflight")

ENTRY_POINT = "trainer.preflight"
# A failing non-chief waits this long for the chief's report before exiting: the launcher stops the whole group
# as soon as one rank exits non-zero, and the chief's preflight.json is what names every rank's problem.
CHIEF_REPORT_WAIT_S = 15.0


class Preflight:
    """One worker's preflight: its checks, the collective phase with its peers, and for the chief the verdict."""

    def __init__(self, cfg: RunConfig, config_url: str, manifest_url: str, output: str,
                 baseline_summary: str | None = None) -> None:
        self.cfg, self.config_url, self.manifest_url, self.output = cfg, config_url, manifest_url, output
        self.baseline_summary = baseline_summary
        self.identity = runtime.worker_identity()
        self.started, self.started_at = time.perf_counter(), utc_now()

    def run(self) -> int:
        report = {**check_worker(self.cfg, self.manifest_url, self.identity), "group_id": group_id(self.identity)}
        for error in report["errors"]:
            log.error("%s", error)
        self._write_rank_report(report)
        if self.identity.num_workers == 1:
            runtime.signal_ready()
            return self._conclude(report, {"skipped": "one worker"})
        with tempfile.TemporaryDirectory(prefix=f"preflight-rank{self.identity.rank}-") as scratch:
            storage.write_json_atomic(os.path.join(scratch, REPORT_FILE), report)
            child = [sys.executable, "-m", ENTRY_POINT, "--config", self.config_url, "--manifest",
                     self.manifest_url, "--output", self.output, "--collectives-in", scratch]
            phase, outcome, collective_s = run_collective_phase(child, scratch, self.cfg.collective_timeout_s)
        if "collectives" not in outcome:
            return self._collectives_failed(phase, outcome["error"], collective_s)
        return self._conclude({**report, "worker_port": outcome["worker_port"]}, outcome["collectives"])

    def _write_rank_report(self, report: dict[str, Any]) -> None:
        try:
            storage.write_json_atomic(PreflightOutput(self.output).rank_report(self.identity.rank), report)
        except Exception as error:  # noqa: BLE001 - check_worker's storage probe reports the cause
            log.error("rank %d: cannot write its preflight report to %s: %s", self.identity.rank, self.output, error)

    def _collectives_failed(self, phase: str, error: str, collective_s: float) -> int:
        reports = read_rank_reports(self.output, self.identity)
        message, probes = collective_failure_message(phase, error, self.identity, reports,
                                                     self.cfg.collective_timeout_s)
        log.error("rank %d on %s: %s", self.identity.rank, self.identity.host, message)
        if self.identity.is_chief:
            # Mismatched versions are a common reason for collectives that never complete.
            self._write_result(reports, errors=[message, *version_skew(reports)], collectives=None,
                               extra={"answered": sorted(reports), "probes": probes,
                                      "failed_after_s": collective_s,
                                      "missing": [r for r in range(self.identity.num_workers) if r not in reports]})
        else:
            self._wait_for_chief_report()
        return EXIT_COLLECTIVES_FAILED

    def _wait_for_chief_report(self) -> None:
        url = PreflightOutput(self.output).result
        deadline = time.monotonic() + CHIEF_REPORT_WAIT_S
        while time.monotonic() < deadline:
            try:
                if storage.read_json(url).get("group_id") == group_id(self.identity):
                    return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.5)

    def _conclude(self, report: dict[str, Any], collectives: dict[str, Any]) -> int:
        own_errors = list(report["errors"])
        if "all_reduce" in collectives:
            if not collectives["all_reduce"]["ok"]:
                own_errors.append(f"all-reduce gave {collectives['all_reduce']['got']}, expected "
                                  f"{collectives['all_reduce']['expected']}: rank(s) "
                                  f"{collectives['all_reduce']['wrong_ranks']} missing or wrong in the sum")
            if not collectives["broadcast"]["ok"]:
                own_errors.append(f"rank {self.identity.rank}: broadcast from the chief gave "
                                  f"{collectives['broadcast']['got']}, expected {collectives['broadcast']['expected']}")
        if not self.identity.is_chief:
            if own_errors:
                self._wait_for_chief_report()
                return EXIT_CHECKS_FAILED
            return 0
        reports = read_rank_reports(self.output, self.identity)
        reports[self.identity.rank] = {**report, "collectives": collectives}
        errors = [e for r in sorted(reports) if r != self.identity.rank for e in reports[r]["errors"]]
        missing = [r for r in range(self.identity.num_workers) if r not in reports]
        if missing:
            errors.append(f"rank(s) {missing} passed the collectives but left no report under {self.output}: "
                          "check their storage access in the task log")
        errors = own_errors + errors + version_skew(reports)
        extra = {}
        if "bandwidth" in collectives and not errors:
            extra["advisor"] = advise(self.cfg, self.identity, config_url=self.config_url,
                                      manifest_url=self.manifest_url, baseline_summary=self.baseline_summary,
                                      collectives=collectives, reports=reports)
            gate = extra["advisor"].get("error")
            if gate:
                errors.append(gate)
        result = self._write_result(reports, errors=errors, collectives=collectives, extra=extra)
        return EXIT_CHECKS_FAILED if result["errors"] else 0

    def _write_result(self, reports: dict[int, dict[str, Any]], *, errors: list[str],
                      collectives: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        result = {
            "status": "failed" if errors else "passed",
            "num_workers": self.identity.num_workers,
            "group_id": group_id(self.identity),
            "started_at": self.started_at,
            "finished_at": utc_now(),
            "wall_time_s": time.perf_counter() - self.started,
            "errors": errors,
            "workers": [reports[r] for r in sorted(reports)],
            "collectives": collectives,
            "config": self.cfg.to_dict(),
            **(extra or {}),
        }
        url = PreflightOutput(self.output).result
        storage.write_json_atomic(url, result)
        print("\n".join(summary_lines(result)), flush=True)
        live = live_values(result)
        if live:
            print_live_line("preflight", live)
        log.info("preflight report written to %s", url)
        return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {ENTRY_POINT}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="RunConfig JSON (path or URL)")
    parser.add_argument("--manifest", required=True, help="manifest.json of the tokenized dataset")
    parser.add_argument("--output", required=True, help="the run's report directory (path or URL)")
    parser.add_argument("--baseline-summary", help="the matching baseline's summary.json: its step time feeds the "
                                                   "scaling advisor when it exists (else a few-step probe)")
    parser.add_argument("--collectives-in", help=argparse.SUPPRESS)  # internal: the child's scratch directory
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    identity = runtime.worker_identity()
    configure_worker_logging(logging.INFO, f"%(asctime)s rank{identity.rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # one INFO line per collective otherwise
    try:
        cfg = load_pinned_config(args.config)
    except ConfigChangedError as error:  # the same file on a retry: permanent, like train's refusals
        log.error("rank %d on %s: cannot start: %s (a retry cannot fix this: exit %d)", identity.rank, identity.host,
                  error, EXIT_PERMANENT)
        return EXIT_PERMANENT
    except (OSError, ValueError) as error:  # ConfigError is a ValueError
        log.error("rank %d on %s: cannot read the run configuration %s: %s", identity.rank, identity.host,
                  args.config, error)
        return EXIT_CHECKS_FAILED
    if args.collectives_in:
        return collectives_main(args.collectives_in, cfg, args.output)
    return Preflight(cfg, args.config, args.manifest, args.output, args.baseline_summary).run()


if __name__ == "__main__":
    sys.exit(main())
