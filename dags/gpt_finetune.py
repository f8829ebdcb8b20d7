"""gpt_finetune: prepare (tokenize, fanned out) -> preflight -> multi-worker training -> baseline comparison ->
promotion -> release.

Thin on purpose: this file is parsed every few seconds by the DAG processor, so it imports only the Task SDK,
pendulum and the settings' declarations (`core.config`) at top level. Task logic lives in `tasks/`, worker code in
`trainer/`, the operator in `plugins/`.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import Asset, AssetAlias, Param, dag, task

from core.config import SETTINGS  # no storage, TF or transformers here
from core.config.schema import param_kwargs

# Cron expression of the nightly run; "none" leaves only manual and API triggers.
_SCHEDULE_SETTING = os.environ.get("GPT_FINETUNE_SCHEDULE", "0 2 * * *").strip()
SCHEDULE = None if _SCHEDULE_SETTING.lower() == "none" else _SCHEDULE_SETTING
DEFAULT_STORAGE_ROOT = os.environ.get("GPT_FINETUNE_STORAGE_ROOT", "storage")
RETRY_DELAY_S = int(os.environ.get("GPT_FINETUNE_RETRY_DELAY_S", "30"))
# The Celery queue served by the GPU hosts' workers (docs/deployment.md, "Deploying on a cluster"); empty: the default
# queue.
DEFAULT_GPU_QUEUE = os.environ.get("GPT_FINETUNE_GPU_QUEUE", "")

PREPARE = "prepare"
# The last prepare step: its XCom (the prepared run: paths, the validated config) is what every later task reads.
PREPARED = "publish"
PLAN_XCOM_KEY = "plan"
WORKER_GROUP_TASKS = ("preflight", "train", "baseline")  # the TFMultiWorkerOperator tasks below
# Updated by every successful prepare; its event's extra names the manifest, so other DAGs can schedule on it.
SHARDS_ASSET = Asset(name="gpt_finetune_shards", uri="gpt-finetune://datasets/shards")
# Updated only when a run is promoted (an alias outlet emits no event by itself); its extra names the version.
MODEL_ASSET = Asset(name="gpt_finetune_model", uri="gpt-finetune://models/latest")
PROMOTIONS = AssetAlias(name="gpt_finetune_promotions")

# One Param per run setting, generated from RunConfig's declarations (core/config/schema.py): the trigger form
# and --conf both go through these, and RunConfig.from_params re-checks everything, including keys Airflow does not
# know.
PARAMS = {setting.name: Param(**param_kwargs(setting, {"storage_root": DEFAULT_STORAGE_ROOT,
                                                       "gpu_queue": DEFAULT_GPU_QUEUE}.get(setting.name)))
          for setting in SETTINGS}

def alert_task_failure(context) -> None:
    """Runs after the task runner reported the failure, inside Airflow's kill window for callbacks (about 25 s:
    `[core] task_success_overtime` then SIGKILL); the alert is sent within tasks.alerts.ALERT_DEADLINE_S or given
    up, logged and counted, and its settings are checked again there (they are the raw params)."""
    from tasks.alerts import alert_task_failure as alert

    alert(context)


DOC = """
### gpt_finetune

Fine-tunes a GPT-2 model with TensorFlow `MultiWorkerMirroredStrategy` on `num_workers` workers.

1. **prepare**: validates the run settings and plans the dataset (cached by fingerprint); **tokenize** (mapped,
   `prepare_tasks` at once) tokenizes large corpora in parallel; **publish** writes the TFRecord shards +
   `manifest.json` (byte-identical whatever the fan-out) and lays out the run.
2. **preflight**: every worker checks versions, devices, disk and storage, then runs collectives with a known
   answer and measures bandwidth; the scaling advisor predicts speedup and efficiency for 1..num_workers.
3. **train**: `TFMultiWorkerOperator` launches the workers, streams their logs, resumes from checkpoints; with
   `min_workers` a retry continues exactly on fewer workers when hosts are lost.
4. **baseline**: the same job on one worker with the same global batch (reused when it matches).
5. **evaluate**: eval loss / perplexity of both models, speedup, scaling efficiency, loss parity; writes the report.
6. **promote**: the model becomes the next version of `model_name` (and updates the Asset `gpt_finetune_model`)
   when its gates passed and its eval loss is not worse than the promoted version's (setting `promote`).
7. **release**: always runs; ends every worker of the run and proves the GPUs are free.

Trigger from the CLI: `airflow dags trigger gpt_finetune --conf '{"num_workers": 4}'`.
"""


# The tasks; gpt_finetune() below wires them with the worker groups.

def the_plan(ti):
    """The dataset plan `prepare` pushed, read as a `DatasetPlan` (unknown, missing or mistyped keys refused)."""
    from tasks.dataset.plan import DatasetPlan

    return DatasetPlan.from_xcom(ti.xcom_pull(task_ids=PREPARE, key=PLAN_XCOM_KEY))


# The promoted model is an inlet: `model: "promoted"` continues from it. A small corpus is prepared here
# whole; a larger one is planned here, tokenized by `tokenize` and published by `publish`. The lanes are the
# return value (what `tokenize` maps over); the plan goes by its own XCom key.
@task(task_id=PREPARE, inlets=[MODEL_ASSET])
def prepare(params=None, run_id=None, dag_run=None, ti=None) -> list:
    from tf_multiworker.backends import make_backend

    from tasks.prepare import plan_run

    planned = plan_run(params, run_id, dag_run.dag_id, make_backend)
    ti.xcom_push(key=PLAN_XCOM_KEY, value=planned.plan.to_xcom())
    return planned.lanes_xcom()


# One mapped task per lane of units, on as many Airflow workers as are free (none for a one-lane plan).
@task(task_id="tokenize", retries=2)
def tokenize(lane: list, ti=None) -> dict:
    from tasks.prepare import tokenize_lane

    return tokenize_lane(the_plan(ti), lane).to_xcom()


@task(task_id=PREPARED, outlets=[SHARDS_ASSET], trigger_rule="none_failed")
def publish(run_id=None, dag_run=None, ti=None, outlet_events=None) -> dict:
    from tasks.prepare import finish_run

    prepared_run = finish_run(the_plan(ti), run_id, dag_run.dag_id)
    outlet_events[SHARDS_ASSET].extra = {
        "manifest_url": prepared_run.manifest_url,
        "fingerprint": prepared_run.dataset_fingerprint,
    }
    return prepared_run.to_xcom()


# Later tasks act on URLs they derive from their own DAG run (tasks/checked_run.py), the XCom's checked against them.
@task.short_circuit(task_id="plan_baseline", ignore_downstream_trigger_rules=False)
def plan_baseline(prepared_run: dict, run_id=None, dag_run=None) -> bool:
    from tasks.baseline import plan_baseline as plan
    from tasks.checked_run import OwnRun
    from tasks.prepared_run import PreparedRun

    return plan(PreparedRun.from_xcom(prepared_run), OwnRun(dag_run.dag_id, run_id))


@task(task_id="evaluate", trigger_rule="none_failed", retries=0)  # its pool (gpu_slots) is set where it is wired
def evaluate(prepared_run: dict, run_id=None, dag_run=None) -> dict:
    from tf_multiworker.backends import make_backend

    from tasks.checked_run import OwnRun
    from tasks.evaluate import evaluate_run
    from tasks.prepared_run import PreparedRun

    return evaluate_run(PreparedRun.from_xcom(prepared_run), OwnRun(dag_run.dag_id, run_id), make_backend).to_xcom()


# all_done: a run whose gates failed still gets its verdict ("not promoted: the gates failed") in the report.
@task(task_id="promote", trigger_rule="all_done", outlets=[PROMOTIONS])
def promote(ti=None, outlet_events=None) -> dict:
    from airflow.sdk.exceptions import AirflowSkipException

    from tasks.checked_run import OwnRun
    from tasks.prepared_run import PreparedRun
    from tasks.promote import NoReportError, promote_run

    prepared_run = ti.xcom_pull(task_ids=PREPARED)
    if not prepared_run:
        raise AirflowSkipException("prepare did not finish: nothing to promote.")
    try:
        promotion = promote_run(PreparedRun.from_xcom(prepared_run), OwnRun(ti.dag_id, ti.run_id))
    except NoReportError as error:
        raise AirflowSkipException(str(error)) from error
    if promotion.promoted:
        outlet_events[PROMOTIONS].add(MODEL_ASSET, extra=promotion.event)
    return promotion.to_xcom()


@task(task_id="release", retries=2)
def release(params=None, run_id=None, dag_run=None, ti=None) -> dict:
    from tf_multiworker.backends import make_backend
    from tf_multiworker.operator import STATE_XCOM_KEY

    from tasks.release import release_run

    # The worker groups' state records as their operators pushed them: release cross-checks storage's copies.
    pushed = {task_id: ti.xcom_pull(task_ids=task_id, key=STATE_XCOM_KEY) for task_id in WORKER_GROUP_TASKS}
    return release_run(params, run_id, dag_run.dag_id, make_backend, pushed=pushed)


# Its failure repeats another task's, which already alerted; a run stopped from outside alerts here.
@task(task_id="outcome", retries=0, on_failure_callback=[])
def outcome(params=None, ti=None) -> dict:
    """Fails the DAG run when any task failed, the run was stopped, or release failed (see tasks/outcome.py)."""
    from airflow.sdk.exceptions import AirflowFailException

    from tasks.alerts import alert_run_stopped
    from tasks.outcome import RunFailedError, judge_run

    states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id])[ti.run_id]
    try:
        return judge_run(states, final_task="promote", own_task=ti.task_id)
    except RunFailedError as error:
        if "failed" not in states.values():
            alert_run_stopped(params, ti.run_id, str(error))
        raise AirflowFailException(str(error)) from error


@dag(
    dag_id="gpt_finetune",
    schedule=SCHEDULE,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    tags=["gpt", "tensorflow", "training"],
    doc_md=DOC,
    params=PARAMS,
    render_template_as_native_obj=True,
    # A retried train task resumes from the run's last checkpoint. A task that fails for good sends an alert
    # (settings alert_conn_id / alert_emails) and counts in the metrics.
    default_args={"retries": 1, "retry_delay": pendulum.duration(seconds=RETRY_DELAY_S),
                  "on_failure_callback": alert_task_failure},
)
def gpt_finetune():
    from tf_multiworker.elastic import ElasticTrainOperator
    from tf_multiworker.gpu_admission import GPU_POOL  # plugins/ is on sys.path when Airflow parses
    from tf_multiworker.operator import TFMultiWorkerOperator

    def prepared(key: str) -> str:
        return "{{ ti.xcom_pull(task_ids='" + PREPARED + "')['" + key + "'] }}"

    def worker_group(task_id: str, entrypoint: str, *, config: str, output: str, extra_args=(),
                     operator=TFMultiWorkerOperator, **kwargs) -> TFMultiWorkerOperator:
        return operator(
            task_id=task_id,
            entrypoint=entrypoint,
            # The validated configuration, once: backend, worker count, GPU use, timeouts, storage and connection.
            run_config="{{ ti.xcom_pull(task_ids='" + PREPARED + "')['config'] }}",
            # The workers' --config and --output; no run_key: the operator derives it from (dag_id, run_id) and
            # holds these to that run's layout, and pins the config's digest itself (core/config/pinned.py).
            config_url=prepared(config),
            output_url=prepared(output),
            args=["--manifest", prepared("manifest_url"), *extra_args],
            manifest_sha256=prepared("manifest_sha256"),  # the dataset, pinned as the config is (trainer/data.py)
            pool=GPU_POOL,  # with use_gpu, one slot per worker (tf_multiworker/gpu_admission.py); CPU runs: none
            **kwargs,
        )

    # The scaling advisor takes a reused baseline's step time instead of its own probe when one exists.
    # Preflight writes preflight.json into the run's report directory (core/layout.py, RunLayout.preflight).
    preflight = worker_group("preflight", "trainer.preflight", config="config_url", output="report_url", retries=0,
                             extra_args=["--baseline-summary", prepared("baseline_summary_url")])
    # A retry (or fewer usable hosts) may continue on fewer workers, down to min_workers (tf_multiworker/elastic.py).
    train = worker_group("train", "trainer.train", config="config_url", output="train_url",
                         summary_url=prepared("train_summary_url"), operator=ElasticTrainOperator)

    baseline = worker_group("baseline", "trainer.train", config="baseline_config_url", output="baseline_url",
                            num_workers=1, summary_url=prepared("baseline_summary_url"))

    prepared_run = publish()
    tokenize.expand(lane=prepare()) >> prepared_run
    evaluation = evaluate.override(pool=GPU_POOL)(prepared_run)
    prepared_run >> preflight >> train >> plan_baseline(prepared_run) >> baseline >> evaluation
    # Both teardowns always run; the DAG run's state is outcome's (release's failure counts through it).
    promotion = promote()
    released = release().as_teardown(on_failure_fail_dagrun=True)
    evaluation >> promotion >> released >> outcome().as_teardown(on_failure_fail_dagrun=True)


gpt_finetune()
