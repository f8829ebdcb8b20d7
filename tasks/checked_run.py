"""The prepared run's storage URLs as a later task derives them: from its own DAG run, never as XCom names them.

`publish` hands every later task the prepared run (tasks/prepared_run.py) through XCom, which others than the run's
tasks can edit. A task acts (deletes, reads, launches) only on URLs it derives itself: the run key from its own
`(dag_id, run_id)`, the storage root from the configuration held to the access policy (tasks/policy.py), and the
dataset fingerprint and baseline key from XCom only when they match their patterns (core/layout.py). Every URL
the prepared run carries must equal the derived one; one that differs is refused by name before anything is done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.config import RunConfig
from core.layout import (
    BASELINE_KEY,
    DATASET_FINGERPRINT,
    RunLayout,
    StorageLayout,
    TrainOutput,
    absolute_root,
    run_key,
)
from tasks.policy import checked_config

if TYPE_CHECKING:
    from tasks.prepared_run import PreparedRun

FIX = ("The prepared run's XCom (task 'publish') was edited, or copied from another run: clear this run's tasks from "
       "'prepare' on, so that publish lays the run out again.")


@dataclass(frozen=True)
class OwnRun:
    """The DAG run a task belongs to, from Airflow's context (`dag_run.dag_id`, `run_id`), never from XCom."""

    dag_id: str
    run_id: str


@dataclass(frozen=True)
class CheckedRun:
    """What a later task acts on, each URL derived, never read from XCom.

    Attributes:
        cfg: the configuration held to the access policy; run_id: the task's own DAG run; key: its run key.
        storage: the layout under the checked `storage_root`; run: the run's own directory there.
        manifest_url: the dataset's manifest.json; manifest_sha256: the digest publish read it with, which the
            evaluation workers pin as the operators pin it on theirs (a digest, not a place: nothing to derive);
        baseline_key: the baseline's key; baseline: its training output.
    """

    cfg: RunConfig
    run_id: str
    key: str
    storage: StorageLayout
    run: RunLayout
    manifest_url: str
    manifest_sha256: str
    baseline_key: str
    baseline: TrainOutput

    @property
    def train(self) -> TrainOutput:
        return self.run.train

    def evaluation(self, model_url: str, output_url: str, label: str) -> Evaluation:
        """The evaluation of `model_url` on this run's sample, its result written at `output_url`."""
        return Evaluation(model_url, self.manifest_url, output_url, label, self.cfg, self.key, self.run_id,
                          self.manifest_sha256)


@dataclass(frozen=True)
class Evaluation:
    """One model to score on a run's evaluation sample: what tasks/evaluate.py's `run_evaluation` launches.

    Attributes:
        model_url: the model directory; manifest_url: the dataset's manifest.json; output_url: where the result goes.
        label: the worker group's name (`evaluate-<label>`) and its log lines'.
        cfg: the run's configuration; run_key: its key (the group's marker and storage layout).
        run_id: the DAG run an idle-held warning is mailed for (None: not mailed).
        manifest_sha256: the digest the workers pin the manifest to (None: not pinned).
    """

    model_url: str
    manifest_url: str
    output_url: str
    label: str
    cfg: RunConfig
    run_key: str
    run_id: str | None = None
    manifest_sha256: str | None = None


def checked_run(prepared: PreparedRun, own: OwnRun) -> CheckedRun:
    """The prepared run's configuration held to the policy and its URLs derived for `own`; AirflowFailException
    naming every field whose XCom value differs from the derived one (the value, what it must be), before the
    caller deletes, reads or launches anything."""
    from airflow.sdk.exceptions import AirflowFailException

    cfg = checked_config(prepared.config)
    key = run_key(own.dag_id, own.run_id)
    storage = StorageLayout(absolute_root(cfg.storage_root))
    for name, pattern, form in (("dataset_fingerprint", DATASET_FINGERPRINT, "20 hex digits"),
                                ("baseline_key", BASELINE_KEY, "<model>-gb<batch>-s<steps>-<16 hex digits>")):
        _check_pattern(name, getattr(prepared, name), pattern, form)
    run, baseline = storage.run(key), storage.baseline(prepared.baseline_key)
    derived = CheckedRun(cfg=cfg, run_id=own.run_id, key=key, storage=storage, run=run,
                         manifest_url=storage.manifest(prepared.dataset_fingerprint),
                         manifest_sha256=prepared.manifest_sha256, baseline_key=prepared.baseline_key,
                         baseline=baseline)
    expected = {
        "run_id": own.run_id, "run_key": key, "config_url": run.config, "manifest_url": derived.manifest_url,
        "train_url": run.train.url, "train_summary_url": run.train.summary, "baseline_url": baseline.url,
        "baseline_config_url": run.baseline_config, "baseline_summary_url": baseline.summary,
        "report_url": run.report,
    }
    wrong = [f"{name} = {getattr(prepared, name)!r} (it must be {value!r})" for name, value in expected.items()
             if getattr(prepared, name) != value]
    if wrong:
        raise AirflowFailException(
            f"The prepared run names storage outside this run's layout: {'; '.join(wrong)}. Each is derived from "
            f"this task's DAG run {own.dag_id!r} / {own.run_id!r} (run key {key!r}) and setting 'storage_root' = "
            f"{cfg.storage_root!r}. {FIX}")
    return derived


def _check_pattern(name: str, value: object, pattern: re.Pattern[str], form: str) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise AirflowFailException(f"The prepared run's {name} = {value!r} is not one: it must be {form} "
                                   f"({pattern.pattern}), a single name under 'storage_root'. {FIX}")
