"""gpt_finetune: prepare (tokenize, fanned out) -> preflight -> multi-worker training -> baseline comparison ->
promotion -> release.

Thin on purpose: this file is parsed every few seconds by the DAG processor, so it imports only the Task SDK and
pendulum at top level. Task logic lives in `tasks/`, worker code in `trainer/`, the operator in `plugins/`.
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import Asset, AssetAlias, Param, dag, task

from launcher.protocol import BACKEND_NAMES, BACKENDS  # one light table (stdlib-only launcher)

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
# Updated by every successful prepare; its event's extra names the manifest, so other DAGs can schedule on it.
SHARDS_ASSET = Asset(name="gpt_finetune_shards", uri="gpt-finetune://datasets/shards")
# Updated only when a run is promoted (an alias outlet emits no event by itself); its extra names the version.
MODEL_ASSET = Asset(name="gpt_finetune_model", uri="gpt-finetune://models/latest")
PROMOTIONS = AssetAlias(name="gpt_finetune_promotions")

# One entry per RunConfig field (trainer/config/): the trigger form and --conf both go through these, and
# RunConfig.from_params re-checks everything, including keys Airflow does not know.
PARAMS = {
    "num_workers": Param(2, type="integer", minimum=1, maximum=64, title="Workers",
                         description="Data-parallel workers (one GPU each when use_gpu is on)."),
    # "null" in the type marks the field optional: empty = num_workers (no recovery on fewer workers).
    "min_workers": Param(None, type=["null", "integer"], minimum=1, maximum=64, title="Minimum workers",
                         description="A retried train task (or one with fewer usable hosts/GPUs) may continue on "
                                     "as few as this many workers, with more accumulation steps keeping the global "
                                     "batch and data order exact; empty = num_workers (off)."),
    "backend": Param("local", type="string", enum=list(BACKEND_NAMES), title="Launcher backend",
                     description="Where workers run: " + "; ".join(f"{name}: {meaning}" for name, meaning
                                                                    in BACKENDS.items()) + "."),
    # "null" in the type marks a field optional: the UI form refuses to submit an empty required value.
    "ssh_conn_ids": Param([], type=["null", "array"], items={"type": "string"}, title="SSH hosts",
                          description="backend ssh: Airflow SSH connection ids, one per host (host-key checking "
                                      "on: give each its host_key extra)."),
    "workers_per_host": Param(0, type="integer", minimum=0, maximum=64, title="Workers per host",
                              description="backend ssh: 0 = one per free GPU with use_gpu, else one per host."),
    "remote_python": Param("", type=["null", "string"], title="Remote Python",
                           description="backend ssh: absolute path of the worker environment's interpreter on "
                                       "the hosts; empty = the same path as on this Airflow worker."),
    "remote_workdir": Param("", type=["null", "string"], title="Remote work directory",
                            description="backend ssh: where ranks run on each host; empty = tfmw/ under the "
                                        "host's temporary directory."),
    "dataset": Param("data/sample/*.txt", type="string", minLength=1, title="Dataset",
                     description="Local path, file:// or s3:// URL (globs allowed) of .txt/.jsonl/.json/.parquet "
                                 "files, or a hub dataset id when online. Relative paths are from the repository; "
                                 "local paths only under GPT_FINETUNE_DATA_ROOTS, buckets only from "
                                 "GPT_FINETUNE_S3_BUCKETS."),
    "text_column": Param("text", type="string", minLength=1, title="Text column",
                         description="Column holding the text in structured files."),
    "tokenizer": Param("bpe:2048", type="string", minLength=1, title="Tokenizer",
                       description="bpe:<vocab> trains a byte-level BPE offline; else a hub name or a path/URL "
                                   "under the allowed data roots or buckets."),
    "model": Param("tiny", type="string", minLength=1, title="Model",
                   description="Preset for random init (tiny, gpt2-124m), a hub name, a save_pretrained path/URL "
                               "under the allowed data roots or buckets, or promoted / promoted:<name> to continue "
                               "from the latest promoted version."),
    "model_revision": Param("", type=["null", "string"], maxLength=255, title="Model revision",
                            description="For a hub model: the branch, tag or commit to fine-tune; empty = main. "
                                        "prepare pins it to the commit sha and fetches the model once into "
                                        "storage_root/models/base/<name>@<sha>/, which every worker loads."),
    "block_size": Param(64, type="integer", minimum=8, maximum=8192, title="Block size",
                        description="Tokens per training sequence."),
    "batch_size_per_worker": Param(8, type="integer", minimum=1, maximum=4096, title="Batch per worker"),
    "max_steps": Param(300, type="integer", minimum=0, maximum=10_000_000, title="Max optimizer steps",
                       description="0 derives the step count from epochs."),
    "epochs": Param(1.0, type="number", exclusiveMinimum=0, maximum=1000, title="Epochs",
                    description="Passes over the training split when max_steps is 0."),
    "learning_rate": Param(3e-3, type="number", exclusiveMinimum=0, maximum=1, title="Peak learning rate"),
    "warmup_steps": Param(20, type="integer", minimum=0, maximum=10_000_000, title="Warmup steps"),
    "weight_decay": Param(0.01, type="number", minimum=0, maximum=1, title="AdamW weight decay"),
    "grad_accum_steps": Param(1, type="integer", minimum=1, maximum=1024, title="Gradient accumulation steps"),
    "mixed_precision": Param("no", type="string", enum=["no", "bf16", "fp16"], title="Mixed precision"),
    "xla": Param(False, type="boolean", title="XLA (jit_compile)"),
    "use_gpu": Param(False, type="boolean", title="Use GPUs",
                     description="Pin one GPU per worker; refuse to start when there are too few."),
    "baseline": Param("auto", type="string", enum=["auto", "run", "skip"], title="Single-GPU baseline",
                      description="auto reuses a matching earlier baseline, run always trains one, skip none."),
    "loss_tolerance": Param(0.02, type="number", minimum=0, maximum=100, title="Eval loss parity tolerance (nats)"),
    "storage_root": Param(DEFAULT_STORAGE_ROOT, type="string", minLength=1, title="Storage root",
                          description="Local path, file:// or s3:// URL for shards, checkpoints and reports "
                                      "(an allowed bucket, see GPT_FINETUNE_S3_BUCKETS)."),
    # "null" in the type marks the field optional: the UI form refuses to submit an empty required string.
    "storage_conn_id": Param("", type=["null", "string"], title="Storage connection",
                             description="Airflow connection (aws type) with S3 credentials; empty uses the "
                                         "environment."),
    "seed": Param(1234, type="integer", minimum=0, maximum=2**31 - 1, title="Seed"),
    "val_fraction": Param(0.05, type="number", exclusiveMinimum=0, maximum=0.5, title="Validation fraction",
                          description="Share of documents held out for evaluation."),
    "eval_tokens": Param(1_000_000, type="integer", minimum=0, maximum=10**12, title="Evaluation tokens",
                         description="Validation tokens each model is scored on: the same sample of the split for "
                                     "every model of a run and every run on the same dataset, read without the "
                                     "rest of it; 0 = the whole split. At least one batch (8 x block_size)."),
    "num_shards": Param(0, type="integer", minimum=0, maximum=100_000, title="Shards",
                        description="0 writes 4 shards per worker; else at least num_workers."),
    "prepare_tasks": Param(0, type="integer", minimum=0, maximum=256, title="Prepare tasks",
                           description="Mapped tasks that tokenize the dataset, at most this many at once: 0 = from "
                                       "the corpus size (one task below 256 MB, then one per 512 MB, at most 32); "
                                       "1 = all in the prepare task. The shards are the same for any value."),
    "prepare_unit_mb": Param(0, type="integer", minimum=0, maximum=1048576, title="Prepare unit (MB)",
                             description="Text per work unit (several per task; a retry redoes only unfinished "
                                         "units); 0 = automatic (16-256 MB). The shards are the same for any value."),
    "bpe_sample_mb": Param(256, type="integer", minimum=1, maximum=1048576, title="BPE sample (MB)",
                           description="tokenizer bpe:<n>: train on at most this much training text, sampled evenly "
                                       "over the corpus (BPE training memory grows with the text it counts)."),
    "max_document_mb": Param(4, type="integer", minimum=1, maximum=1024, title="Longest document (MB)",
                             description="A paragraph, JSON line or Parquet cell longer than this is cut into "
                                         "several documents (prepare's memory stays bounded); a JSON line over 4x "
                                         "this is refused."),
    "checkpoint_every_steps": Param(20, type="integer", minimum=1, maximum=10_000_000,
                                    title="Checkpoint interval (steps)"),
    "preemption_checkpoint_s": Param(8, type="integer", minimum=0, maximum=3600, title="Preemption checkpoint (s)",
                                     description="A training worker that gets SIGTERM (spot reclaim, node drain) saves "
                                                 "a checkpoint within this many seconds and the retry resumes there "
                                                 "(0 = off)."),
    "communication": Param("auto", type="string", enum=["auto", "ring", "nccl"], title="Collective implementation"),
    "allreduce_dtype": Param("float32", type="string", enum=["float32", "bfloat16"], title="Gradients on the wire",
                             description="bfloat16 halves the bytes each step sends across the network (gradients "
                                         "are cast for the all-reduce only; accumulation and the update stay "
                                         "float32); float32 keeps exact parity with the baseline."),
    "allreduce_pack_mb": Param(32, type="number", minimum=0, maximum=1024, title="All-reduce pack size (MiB)",
                               description="Gradients go out in packs of at least this size while the backward "
                                           "pass still runs (overlap); 0 sends one pack after it. No overlap "
                                           "with XLA."),
    "collective_timeout_s": Param(300, type="integer", minimum=5, maximum=86_400,
                                  title="Preflight collective timeout (s)",
                                  description="Bound on the preflight's collectives; training collectives have "
                                              "none (a lost peer is caught by heartbeats, a stuck one by the hang "
                                              "watchdog)."),
    "startup_timeout_s": Param(180, type="integer", minimum=5, maximum=86_400, title="Worker start-up timeout (s)",
                               description="Time for every worker to come up and join the group."),
    "hang_timeout_s": Param(600, type="integer", minimum=10, maximum=7 * 86_400, title="Hang watchdog (s)",
                            description="End a group whose workers are alive but print nothing for this long "
                                        "(a hung collective); must exceed the first step's compilation."),
    "model_name": Param("gpt_finetune", type="string", pattern="^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
                        title="Registered model name",
                        description="Promoted versions go to storage_root/models/<model_name>/v<N>/."),
    "promotion_tolerance": Param(0.0, type="number", minimum=0, maximum=100, title="Promotion tolerance (nats)",
                                 description="How much worse than the promoted version's eval loss a run may be "
                                             "and still be promoted (promote = auto)."),
    "promote": Param("auto", type="string", enum=["auto", "always", "never"], title="Promotion",
                     description="auto: promote when the gates passed and eval loss is not worse than the promoted "
                                 "version's by more than promotion_tolerance; always: whenever the gates passed; "
                                 "never."),
    "export_formats": Param(["safetensors", "saved_model", "tf_h5"], type="array",
                            items={"type": "string", "enum": ["safetensors", "saved_model", "tf_h5"]},
                            uniqueItems=True, title="Export formats",
                            description="Formats the model is exported in, each read back and compared with the "
                                        "trained model (logits within 1e-4, same greedy tokens) before it may be "
                                        "promoted: safetensors (PyTorch / transformers 5), saved_model (TF "
                                        "Serving), tf_h5 (transformers 4.57 TF, always written). [] writes "
                                        "tf_model.h5 alone, unchecked."),
    # backend=kubernetes: one pod per worker (docs/backends.md, "Kubernetes").
    "kubernetes_conn_id": Param("", type=["null", "string"], title="Kubernetes connection",
                                description="Airflow connection (kubernetes type) of the cluster; empty uses the "
                                            "in-cluster configuration of the Airflow worker's pod."),
    "namespace": Param("default", type="string", minLength=1, maxLength=63, pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                       title="Kubernetes namespace", description="Namespace of the worker pods (a DNS label)."),
    "image": Param("gpt-finetune-trainer:2.21.0", type="string", title="Trainer image",
                   description="Image of the worker pods (docker/trainer.Dockerfile)."),
    "gpus_per_worker": Param(0, type="integer", minimum=0, maximum=1, title="GPUs per pod",
                             description="nvidia.com/gpu requested by each pod; 0 = one with use_gpu. Needs "
                                         "use_gpu. One GPU per worker: more are not supported yet, run more "
                                         "workers instead."),
    "cpu": Param("", type=["null", "string"], title="CPU request per pod", description="e.g. 4 or 500m; empty: none."),
    "memory": Param("", type=["null", "string"], title="Memory request per pod",
                    description="e.g. 16Gi; empty: none."),
    "node_selector": Param({}, type="object", additionalProperties={"type": "string"}, title="Node selector",
                           description="Node labels the pods must match, e.g. {\"nvidia.com/gpu.product\": "
                                       "\"NVIDIA-H200\"}."),
    "tolerations": Param([], type="array", items={"type": "object"}, title="Tolerations",
                         description="Pod tolerations in Kubernetes spelling, e.g. [{\"key\": \"nvidia.com/gpu\", "
                                     "\"operator\": \"Exists\", \"effect\": \"NoSchedule\"}]."),
    "service_account": Param("", type=["null", "string"], title="Service account",
                             description="Service account of the worker pods (e.g. for storage access); empty: the "
                                         "namespace's default."),
    "keep_failed_pods": Param(False, type="boolean", title="Keep failed pods",
                              description="Leave failed worker pods in the cluster for debugging; everything else "
                                          "of the run is still deleted."),
    "min_predicted_efficiency": Param(0.0, type="number", minimum=0, maximum=1,
                                      title="Minimum predicted scaling efficiency",
                                      description="Preflight fails, before training, when the scaling advisor "
                                                  "predicts num_workers below this efficiency (0 = off)."),
    "gpu_queue": Param(DEFAULT_GPU_QUEUE, type=["null", "string"], pattern="^([A-Za-z0-9][A-Za-z0-9_.-]{0,199})?$",
                       title="GPU queue",
                       description="Celery queue of preflight, train, baseline and evaluate (the tasks that hold "
                                   "gpu_slots), served by the GPU hosts' workers; empty = the default queue. A "
                                   "queue no worker serves leaves them queued until task_queued_timeout."),
    "max_loss_rise": Param(3.0, type="number", minimum=0, maximum=100, title="Loss divergence limit (nats)",
                           description="Train fails at the step whose loss lies more than this above its lowest so "
                                       "far (0 = off; a NaN loss always fails)."),
    "min_throughput_ratio": Param(0.5, type="number", minimum=0, maximum=1, title="Throughput warning ratio",
                                  description="Warn (log, report, alert) when tokens/s falls below this share of the "
                                              "advisor's prediction or the last comparable run's (0 = off)."),
    "alert_conn_id": Param("", type=["null", "string"], title="Alert connection",
                           description="Airflow connection (smtp type) that sends failure and throughput alerts; "
                                       "empty = no alerts."),
    "alert_emails": Param([], type=["null", "array"], items={"type": "string"}, title="Alert recipients",
                          description="E-mail addresses of the alerts; required with an alert connection."),
    "capacity": Param("on_demand", type="string", enum=["on_demand", "reserved", "spot"], title="Capacity",
                      description="Which rate of the operator's pricing table (GPT_FINETUNE_PRICING) prices the run."),
    "max_idle_held_s": Param(900, type="integer", minimum=0, maximum=30 * 86_400, title="Idle-held warning (s)",
                             description="Warn when a group held its GPUs this long without step progress (0 = off)."),
    "min_cost_efficiency": Param(0.5, type="number", minimum=0, maximum=1, title="Cost efficiency warning",
                                 description="Warn when the measured scaling efficiency is below this: extra workers "
                                             "more than 1/E the GPU-hours per token (0 = off)."),
    "max_release_s": Param(300, type="integer", minimum=0, maximum=86_400, title="Release warning (s)",
                           description="Warn when the GPUs were free later than this after the last worker exited "
                                       "(0 = off)."),
    "max_run_cost": Param(0.0, type="number", minimum=0, maximum=1e12, title="Run budget",
                          description="Preflight fails when the advisor predicts the run above this cost, in the "
                                      "pricing table's currency (0 = off)."),
}

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

def the_plan(ti) -> dict:
    return ti.xcom_pull(task_ids=PREPARE, key=PLAN_XCOM_KEY)


# The promoted model is an inlet: `model: "promoted"` continues from it. A small corpus is prepared here
# whole; a larger one is planned here, tokenized by `tokenize` and published by `publish`. The lanes are the
# return value (what `tokenize` maps over); the plan goes by its own XCom key.
@task(task_id=PREPARE, inlets=[MODEL_ASSET])
def prepare(params=None, run_id=None, dag_run=None, ti=None) -> list:
    from tf_multiworker.backends import make_backend

    from tasks.prepare import plan_run

    planned = plan_run(params, run_id, dag_run.dag_id, make_backend)
    ti.xcom_push(key=PLAN_XCOM_KEY, value=planned["plan"])
    return planned["lanes"]


# One mapped task per lane of units, on as many Airflow workers as are free (none for a one-lane plan).
@task(task_id="tokenize", retries=2)
def tokenize(lane: list, ti=None) -> dict:
    from tasks.prepare import tokenize_lane

    return tokenize_lane(the_plan(ti), lane)


@task(task_id=PREPARED, outlets=[SHARDS_ASSET], trigger_rule="none_failed")
def publish(run_id=None, dag_run=None, ti=None, outlet_events=None) -> dict:
    from tasks.prepare import finish_run

    prepared_run = finish_run(the_plan(ti), run_id, dag_run.dag_id)
    outlet_events[SHARDS_ASSET].extra = {
        "manifest_url": prepared_run["manifest_url"],
        "fingerprint": prepared_run["dataset_fingerprint"],
    }
    return prepared_run


@task.short_circuit(task_id="plan_baseline", ignore_downstream_trigger_rules=False)
def plan_baseline(prepared_run: dict) -> bool:
    from tasks.baseline import plan_baseline as plan

    return plan(prepared_run)


@task(task_id="evaluate", trigger_rule="none_failed", retries=0)  # its pool (gpu_slots) is set where it is wired
def evaluate(prepared_run: dict) -> dict:
    from tf_multiworker.backends import make_backend

    from tasks.compare import evaluate_run

    return evaluate_run(prepared_run, make_backend)


# all_done: a run whose gates failed still gets its verdict ("not promoted: the gates failed") in the report.
@task(task_id="promote", trigger_rule="all_done", outlets=[PROMOTIONS])
def promote(ti=None, outlet_events=None) -> dict:
    from airflow.sdk.exceptions import AirflowSkipException

    from tasks.promote import NoReportError, promote_run

    prepared_run = ti.xcom_pull(task_ids=PREPARED)
    if not prepared_run:
        raise AirflowSkipException("prepare did not finish: nothing to promote.")
    try:
        promotion = promote_run(prepared_run)
    except NoReportError as error:
        raise AirflowSkipException(str(error)) from error
    if promotion["promoted"]:
        outlet_events[PROMOTIONS].add(MODEL_ASSET, extra=promotion["event"])
    return promotion


@task(task_id="release", retries=2)
def release(params=None, run_id=None, dag_run=None) -> dict:
    from tf_multiworker.backends import make_backend

    from tasks.release import release_run

    return release_run(params, run_id, dag_run.dag_id, make_backend)


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
            # No run_key: the operator derives it from (dag_id, run_id), never from XCom.
            args=["--config", prepared(config), "--manifest", prepared("manifest_url"), "--output", prepared(output),
                  *extra_args],
            pool=GPU_POOL,  # with use_gpu, one slot per worker (tf_multiworker/gpu_admission.py); CPU runs: none
            **kwargs,
        )

    # The scaling advisor takes a reused baseline's step time instead of its own probe when one exists.
    preflight = worker_group("preflight", "trainer.preflight", config="config_url", output="preflight_url", retries=0,
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
