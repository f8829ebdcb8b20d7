"""The results of the tasks the DAG reads or hands on: typed where the task makes them, checked where they are read.

Each is a `Document`: the task returns `to_xcom()` for readers downstream of the DAG (no task of it reads the value
back); one that does takes it back with `from_xcom()`, as XCom is untrusted input (docs/security.md).
docs/CONTRACTS.md ("Task results") points at these docstrings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.document import Document


@dataclass(frozen=True)
class Evaluated(Document):
    """The evaluate task's result (its gates passed: a failed gate fails the task).

    Attributes:
        report_json_url: the run's report.json (report.md follows beside it: the release task renders it).
        speedup, efficiency: the distributed run against the single-worker baseline (None without one).
        eval_loss: the distributed model's; baseline_eval_loss: the baseline's (None without one).
        gates_passed: always true here.
    """

    report_json_url: str
    speedup: float | None
    efficiency: float | None
    eval_loss: float
    baseline_eval_loss: float | None
    gates_passed: bool


@dataclass(frozen=True)
class Promotion(Document):
    """The promote task's outcome: what the report, the task log and (as `event`) downstream DAGs learn.

    Attributes:
        promoted: whether this run became a version of `model_name`; reason: why (not).
        policy: the run's `promote` setting; model_name: the registered model.
        compared_with: the promotion rule's reference (`tasks.promote.Reference` as JSON; None: none needed).
        version, url, model_url: the version it became, its folder and model (None: not promoted).
        event: the model Asset event's extra (None: not promoted); decided_at: when (UTC, ISO 8601).
    """

    promoted: bool
    policy: str
    model_name: str
    reason: str
    compared_with: dict[str, Any] | None
    version: str | None
    url: str | None
    model_url: str | None
    event: dict[str, Any] | None
    decided_at: str
