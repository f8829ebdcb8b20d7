"""The prepare stage's Airflow side: `prepare` validates the run settings once and plans (or, for a small corpus,
builds) the dataset, mapped `tokenize` tasks tokenize its lanes, `publish` publishes it and lays out the run.

Everything later tasks need travels in the prepared run `publish` returns (XCom, tasks/prepared_run.py): paths and a
few numbers, never data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from core.config import ConfigError, RunConfig
from core.config.access import AccessPolicy
from core.config.pinned import save_config
from core.layout import StorageLayout, absolute_root, run_key
from tasks.connections import storage_env, uses_run_storage
from tasks.dataset.plan import DatasetPlan
from tasks.ledger.pricing import Price
from tasks.policy import checked_config
from tasks.prepared_run import PreparedRun
from tasks.registry import PromotedVersion

if TYPE_CHECKING:
    from launcher.backend import BackendFactory
    from tasks.dataset.records import LaneResult, Unit

log = logging.getLogger("gpt_finetune.prepare")


def build_config(params: Mapping[str, Any]) -> RunConfig:
    """Params (UI form or --conf) -> the validated config, with `storage_root` made absolute. The one check of the
    access policy (`RunConfig.from_params`; release repeats it on the same params): later tasks and the workers
    load the saved config with `from_saved`."""
    cfg = RunConfig.from_params(dict(params))
    return cfg.replace(storage_root=absolute_root(cfg.storage_root))


@dataclass(frozen=True)
class PlannedRun:
    """What `prepare` (`plan_run`) returns to its DAG task: the dataset plan (its XCom key `plan`) and the lanes
    of units the mapped `tokenize` tasks take (none when `prepare` prepared the dataset itself)."""

    plan: DatasetPlan
    lanes: tuple[tuple[Unit, ...], ...] = ()

    def lanes_xcom(self) -> list[list[dict[str, Any]]]:
        """The lanes as the task returns them (what `tokenize` maps over): lists of units' `to_xcom()`."""
        return [[unit.to_xcom() for unit in lane] for lane in self.lanes]


@uses_run_storage
def plan_run(params: Mapping[str, Any], run_id: str, dag_id: str, make_backend: BackendFactory) -> PlannedRun:
    """The first task: the settings checked once, then the dataset planned. A small corpus (one lane) is prepared
    here completely; a larger one returns its lanes for the mapped `tokenize` tasks: small documents only."""
    started = time.perf_counter()  # the stage's figures count its imports below too
    from airflow.sdk.exceptions import AirflowFailException

    from launcher import LaunchError
    from tasks.alerts import check_alert_connection
    from tasks.base_models import check_model_setting, resolve_base_model
    from tasks.dataset.stage import plan_dataset, run_planned
    from tasks.ledger.pricing import freeze, table_from_env
    from tasks.promote import resolve_promoted_model
    from tasks.queues import report_gpu_queue

    try:
        cfg, continued_from = resolve_promoted_model(build_config(params))
        cfg, _ = resolve_base_model(cfg)  # a hub name: pinned to a commit, fetched once into storage
        check_model_setting(cfg)  # its config and tensor headers: a checkpoint the workers cannot load fails here
        # The run's connections exist and are of the right type (nothing is contacted yet).
        make_backend(cfg).close()
        storage_env(cfg.storage_conn_id)
        check_alert_connection(cfg)
        table, source = table_from_env()  # the operator's prices: a bad table is refused here, by name
        price = freeze(table, source, backend=cfg.launch.backend, queue=cfg.launch.gpu_queue,
                       capacity=cfg.monitoring.capacity, use_gpu=cfg.use_gpu)
    except (ConfigError, LaunchError) as exc:  # bad settings do not get better on retry: fail now
        raise AirflowFailException(str(exc)) from exc
    log.info("Run configuration (validated):\n  %s", "\n  ".join(cfg.summary_lines()))
    report_gpu_queue(cfg)
    log.info("Price: %s", f"{price.default} {price.currency} per {price.unit.replace('_', '-')} "
             f"({price.capacity}; {price.source})" if price else "none (no GPT_FINETUNE_PRICING): cost not shown")

    planned = plan_dataset(cfg, started=started, policy=AccessPolicy.from_env())
    plan = replace(planned.dataset_plan(cfg), continued_from=continued_from, price=price)
    if plan.cache_hit or len(planned.lanes) == 1:
        return PlannedRun(replace(plan, dataset=run_planned(planned, cfg, started=started)))
    log.info("tokenizing in %d mapped tasks (prepare_tasks=%d): %s", len(planned.lanes), cfg.prepare_tasks,
             ", ".join(f"task {i}: {len(lane)} unit(s)" for i, lane in enumerate(planned.lanes)))
    return PlannedRun(plan, planned.lanes)


@uses_run_storage
def tokenize_lane(plan: DatasetPlan, lane: Any) -> LaneResult:
    """A mapped task: the units of one `lane` (its XCom) (a retry redoes only those not complete). From the plan
    (XCom) it takes the checked configuration and the plan's ids; the whole plan is read from the run's own storage
    root and checked with the lane against the policy before anything is read (tasks/dataset/checks.py)."""
    from tasks.dataset.checks import checked_lane, checked_plan
    from tasks.dataset.stage import tokenize_lane as run

    work = checked_plan(plan, checked_config(plan.config), AccessPolicy.from_env())
    return run(work, checked_lane(work, lane))


@uses_run_storage
def finish_run(plan: DatasetPlan, run_id: str, dag_id: str) -> PreparedRun:
    """The last prepare step: the dataset published (unless the first task did it), then the run laid out. Its
    XCom (`PreparedRun.to_xcom()`) is what every later task reads."""
    from tasks.dataset.checks import FINGERPRINT, checked_plan
    from tasks.dataset.errors import PrepareError
    from tasks.dataset.stage import finish_dataset
    from trainer.data import read_manifest

    cfg = checked_config(plan.config)
    dataset = plan.dataset or finish_dataset(checked_plan(plan, cfg, AccessPolicy.from_env()), cfg)
    if not FINGERPRINT.fullmatch(str(dataset.fingerprint)) or \
            dataset.manifest_url != StorageLayout(cfg.storage_root).manifest(dataset.fingerprint):
        raise PrepareError(f"The prepared dataset's manifest {dataset.manifest_url!r} is not where its fingerprint "
                           f"{dataset.fingerprint!r} lies under the storage root: refusing it.")
    manifest, manifest_sha256 = read_manifest(dataset.manifest_url)
    total_steps = cfg.steps_for(dataset.train_sequences)
    run_cfg = cfg.replace(max_steps=total_steps, warmup_steps=min(cfg.warmup_steps, total_steps - 1))

    log.info(
        "Dataset %s (%s): %d train / %d validation sequences; %d optimizer steps of %d sequences",
        dataset.fingerprint, "cache hit" if dataset.cache_hit else "tokenized", dataset.train_sequences,
        dataset.validation_sequences, total_steps, cfg.global_batch_size,
    )
    return lay_out_run(run_cfg, PublishedManifest(manifest, dataset.manifest_url, manifest_sha256),
                       run_key(dag_id, run_id), run_id=run_id, continued_from=plan.continued_from, price=plan.price)


@dataclass(frozen=True)
class PublishedManifest:
    """The dataset's manifest as publish read it: its document, where it lies, and the sha256 of its bytes."""

    document: Mapping[str, Any]
    url: str
    sha256: str


def lay_out_run(run_cfg: RunConfig, published: PublishedManifest, key: str, *, run_id: str,
                continued_from: PromotedVersion | None = None, price: Price | None = None) -> PreparedRun:
    """Write the run's configuration and its baseline's under the run's directory and return the prepared run
    (tasks/prepared_run.py), the XCom every later task reads: paths, the configurations' and the manifest's digests
    and a few numbers. `run_cfg` has its step count resolved; `price` is the rate prepare froze
    (tasks/ledger/pricing.py), kept with the run."""
    from tasks.baseline import baseline_key
    from tasks.ledger.record import write_price

    storage = StorageLayout(run_cfg.storage_root)
    run = storage.run(key)
    base_key = baseline_key(run_cfg, published.document, run_cfg.max_steps)
    baseline = storage.baseline(base_key)
    # The operators pin the digests of what they check on the workers (core/config/pinned.py).
    save_config(run.config, run_cfg)
    save_config(run.baseline_config, run_cfg.baseline_config())
    write_price(run.url, price)
    log.info("Run directory %s", run.url)
    return PreparedRun(
        run_id=run_id,
        run_key=key,
        config=run_cfg.to_dict(),
        config_url=run.config,
        manifest_url=published.url,
        manifest_sha256=published.sha256,
        dataset_fingerprint=published.document["fingerprint"],
        train_url=run.train.url,
        train_summary_url=run.train.summary,
        baseline_key=base_key,
        baseline_url=baseline.url,
        baseline_config_url=run.baseline_config,
        baseline_summary_url=baseline.summary,
        report_url=run.report,
        continued_from=continued_from,
        price=price,
    )
