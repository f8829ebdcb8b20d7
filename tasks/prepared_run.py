"""The prepared run: the document `publish` hands every later task (XCom), paths and a few numbers, never data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.document import Document
from tasks.ledger.pricing import Price
from tasks.registry import PromotedVersion


@dataclass(frozen=True)
class PreparedRun(Document):
    """What `publish` (`tasks.prepare.finish_run` -> `lay_out_run`) returns and every later task reads.

    Attributes:
        run_id: the DAG run's id.
        run_key: the run's storage name (`core.layout.run_key(dag_id, run_id)`); the operator derives its own.
        config: the run's validated configuration (`RunConfig.to_dict()`, step count resolved, `storage_root`
            absolute): the one copy in flight. Every task that acts on it holds it to the access policy again
            (tasks/policy.py); its storage root and step count are read from it, never copied.
        config_url: `runs/<key>/config.json`, what the workers load (`--config`); the operators pin the sha256 of
            the configuration they check themselves, never one from XCom (core/config/pinned.py).
        manifest_url: the dataset's `manifest.json` (`--manifest`); manifest_sha256: the sha256 of its bytes as
            publish read them, which the operators pin on the workers like the config's (trainer/data.py).
        dataset_fingerprint: the dataset's fingerprint (the manifest's).
        train_url: the train task's output directory; train_summary_url: its `summary.json`.
        baseline_key: the baseline's key (tasks/baseline.py); baseline_url: its directory under `baselines/`;
            baseline_config_url: `runs/<key>/baseline_config.json`;
            baseline_summary_url: the baseline's `summary.json`.
        report_url: the run's report directory `runs/<key>/report/`: report.json and the charts (evaluate),
            promotion.json (promote), release.json, the usage chart and report.md (release); preflight.json
            (preflight).
        continued_from: with `model: promoted[:<name>]`, the version it continues from
            (`tasks.registry.PromotedVersion`); else None.
        price: the rate prepare froze (tasks/ledger/pricing.py, `usage/price.json`), None without a pricing table.
    """

    run_id: str
    run_key: str
    config: dict[str, Any]
    config_url: str
    manifest_url: str
    manifest_sha256: str
    dataset_fingerprint: str
    train_url: str
    train_summary_url: str
    baseline_key: str
    baseline_url: str
    baseline_config_url: str
    baseline_summary_url: str
    report_url: str
    continued_from: PromotedVersion | None = None
    price: Price | None = None
