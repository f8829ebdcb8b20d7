"""GPU admission policy: a run's settings -> the pool and slots of each task instance of gpt_finetune.

Task instances are built from the serialized DAG, as the scheduler builds them, and mutated through Airflow's own
policy hook (`airflow.settings.task_instance_mutation_hook`), so these tests also fail when the project's
airflow_local_settings is not loaded. The scheduler itself: tests/e2e/test_scheduling.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from tf_multiworker.gpu_admission import DEFAULT_POOL, GPU_POOL, SLOTS_SETTING, configured_pool_size, detected_gpus

from tests.support.airflow_stack import REPO, airflow_env

GPU_TASKS = {"preflight", "train", "baseline", "evaluate"}


@pytest.fixture(scope="module")
def scheduler_dag():
    """gpt_finetune as the scheduler sees it: parsed, serialized, deserialized."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    bag = DagBag(dag_folder=str(REPO / "dags"))
    assert bag.import_errors == {}
    return DagSerialization.from_dict(DagSerialization.to_dict(bag.dags["gpt_finetune"]))


def admitted(dag, conf: dict, session=None) -> dict[str, tuple[str, int]]:
    """task_id -> (pool, pool_slots) of the task instances a run with `conf` gets (as verify_integrity makes them)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.settings import task_instance_mutation_hook

    dag_run = DagRun(dag_id=dag.dag_id, run_id="manual__admission", conf=conf, run_type="manual")
    if session is not None:
        session.add(dag_run)
    result = {}
    for task in dag.tasks:
        ti = TaskInstance(task, run_id=dag_run.run_id, map_index=-1, dag_version_id=None)
        task_instance_mutation_hook(ti, dag_run=dag_run)
        result[ti.task_id] = (ti.pool, ti.pool_slots)
    return result


def queues(dag, conf: dict) -> dict[str, str]:
    """task_id -> the queue of the task instances a run with `conf` gets."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.settings import task_instance_mutation_hook

    dag_run = DagRun(dag_id=dag.dag_id, run_id="manual__queues", conf=conf, run_type="manual")
    result = {}
    for task in dag.tasks:
        ti = TaskInstance(task, run_id=dag_run.run_id, map_index=-1, dag_version_id=None)
        task_instance_mutation_hook(ti, dag_run=dag_run)
        result[ti.task_id] = ti.queue
    return result


@pytest.mark.parametrize("use_gpu", [True, False])
def test_the_gpu_slot_tasks_and_release_go_to_the_gpu_queue_and_the_rest_stays_on_the_default(scheduler_dag,
                                                                                             use_gpu):
    """Whatever use_gpu: these tasks launch the workers, which the local backend starts on their own host, and
    release ends and checks what is left on its own host, so it follows them there (without a GPU slot)."""
    routed = queues(scheduler_dag, {"gpu_queue": "gpu", "use_gpu": use_gpu})
    assert {task for task, queue in routed.items() if queue == "gpu"} == GPU_TASKS | {"release"}
    assert {routed[task] for task in routed.keys() - GPU_TASKS - {"release"}} == {"default"}
    assert admitted(scheduler_dag, {"gpu_queue": "gpu", "use_gpu": use_gpu})["release"] == (DEFAULT_POOL, 1)


def test_prepare_warns_when_several_workers_serve_the_gpu_queue(monkeypatch, caplog):
    """Several hosts on one gpu_queue: a run's groups may land on different hosts, which release cannot all check."""
    from core.config import RunConfig
    from tasks import queues as gpu_queues

    monkeypatch.setattr(gpu_queues, "served_queues", lambda: {"gpu@a": ["gpu"], "gpu@b": ["gpu", "gpu-b"],
                                                             "default@c": ["default"]})
    with caplog.at_level(logging.INFO, logger="gpt_finetune.queues"):
        gpu_queues.report_gpu_queue(RunConfig.of(gpu_queue="gpu"))
    text = caplog.text
    assert "preflight, train, baseline, evaluate, release run on queue 'gpu', served by gpu@a, gpu@b" in text
    assert "served by 2 workers" in text and "airflow celery worker -q gpu,gpu-<host>" in text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpt_finetune.queues"):
        gpu_queues.report_gpu_queue(RunConfig.of(gpu_queue="gpu-b"))
    assert "served by gpu@b" in caplog.text and "WARNING" not in caplog.text


@pytest.mark.parametrize("conf", [{}, {"gpu_queue": ""}, {"gpu_queue": None}, {"gpu_queue": "gpu,default"}])
def test_no_gpu_queue_or_a_malformed_one_leaves_every_task_on_the_default_queue(scheduler_dag, conf):
    assert set(queues(scheduler_dag, conf).values()) == {"default"}  # a malformed one: prepare refuses it


@pytest.mark.parametrize("num_workers", [1, 3])
def test_gpu_runs_take_one_slot_per_gpu(scheduler_dag, num_workers):
    pools = admitted(scheduler_dag, {"use_gpu": True, "num_workers": num_workers})
    # evaluate scores each model on every worker of the run; the baseline trains on one.
    assert pools["preflight"] == pools["train"] == pools["evaluate"] == (GPU_POOL, num_workers)
    assert pools["baseline"] == (GPU_POOL, 1)
    assert {task: pools[task] for task in pools.keys() - GPU_TASKS} == dict.fromkeys(pools.keys() - GPU_TASKS,
                                                                                     (DEFAULT_POOL, 1))


@pytest.mark.parametrize("conf", [{}, {"use_gpu": False, "num_workers": 4}])
def test_cpu_runs_do_not_need_the_pool(scheduler_dag, conf):
    assert set(admitted(scheduler_dag, conf).values()) == {(DEFAULT_POOL, 1)}


def test_settings_missing_from_the_conf_come_from_the_param_defaults(scheduler_dag):
    default_workers = scheduler_dag.params["num_workers"]
    assert admitted(scheduler_dag, {"use_gpu": True})["train"] == (GPU_POOL, default_workers)


def test_a_malformed_worker_count_holds_one_slot_until_prepare_refuses_it(scheduler_dag):
    assert admitted(scheduler_dag, {"use_gpu": True, "num_workers": "4"})["train"] == (GPU_POOL, 1)


def test_a_cleared_task_instance_gets_the_run_s_slots_again(scheduler_dag):
    """Clearing a task (UI, API, `airflow tasks clear`) refreshes it from its task with its run: the hook runs again."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance

    dag_run = DagRun(dag_id=scheduler_dag.dag_id, run_id="manual__cleared", conf={"use_gpu": True, "num_workers": 3},
                     run_type="manual")
    task = scheduler_dag.get_task("train")
    ti = TaskInstance(task, run_id=dag_run.run_id, map_index=-1, dag_version_id=None)
    assert (ti.pool, ti.pool_slots) == (GPU_POOL, 1)  # as declared: no run bound yet
    ti.refresh_from_task(task, dag_run=dag_run)  # what clear_task_instances does
    assert (ti.pool, ti.pool_slots) == (GPU_POOL, 3)


@pytest.fixture
def pool_session():
    """A session on a throw-away database holding only Airflow's pool table."""
    from airflow.models.pool import Pool
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    engine = create_engine("sqlite://")
    Pool.__table__.create(engine)
    with Session(engine) as session:
        yield session


def test_a_request_above_the_pool_takes_the_whole_pool_instead_of_waiting_forever(scheduler_dag, pool_session,
                                                                                   caplog):
    from airflow.models.pool import Pool

    pool_session.add(Pool(pool=GPU_POOL, slots=3, include_deferred=False))
    pool_session.flush()
    with caplog.at_level(logging.WARNING, logger="tf_multiworker.gpu_admission"):
        pools = admitted(scheduler_dag, {"use_gpu": True, "num_workers": 8}, session=pool_session)
    assert pools["train"] == (GPU_POOL, 3) and pools["baseline"] == (GPU_POOL, 1)
    assert "needs 8 GPUs but pool 'gpu_slots' has 3 slots" in caplog.text and SLOTS_SETTING in caplog.text


def test_a_missing_pool_is_reported_with_the_setting_that_creates_it(scheduler_dag, pool_session, caplog):
    with caplog.at_level(logging.WARNING, logger="tf_multiworker.gpu_admission"):
        pools = admitted(scheduler_dag, {"use_gpu": True, "num_workers": 2}, session=pool_session)
    assert pools["train"] == (GPU_POOL, 2)
    assert "Pool 'gpu_slots' does not exist" in caplog.text and SLOTS_SETTING in caplog.text


def test_every_airflow_process_loads_the_policy(tmp_path):
    """Airflow creates task instances without calling the hook unless airflow_local_settings defines it."""
    code = ("import airflow.settings as s; hook = s.get_policy_plugin_manager().hook.task_instance_mutation_hook; "
            "print(s.task_instance_mutation_hook.is_noop, [impl.function.__module__ for impl in hook.get_hookimpls()])")
    env = airflow_env(tmp_path / "home", 8080)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True, timeout=300).stdout.strip().splitlines()[-1]
    assert out == "False ['tf_multiworker.gpu_admission']"


@pytest.mark.parametrize("value, expected", [("", None), ("4", 4), (" 2 ", 2)])
def test_pool_size_setting(monkeypatch, value, expected):
    monkeypatch.setenv(SLOTS_SETTING, value)
    assert configured_pool_size() == expected


@pytest.mark.parametrize("value", ["0", "-1", "four", "2.5"])
def test_a_malformed_pool_size_names_the_setting(monkeypatch, value):
    monkeypatch.setenv(SLOTS_SETTING, value)
    with pytest.raises(ValueError, match=f"{SLOTS_SETTING}='{value}'"):
        configured_pool_size()


def test_the_pool_counts_the_gpus_nvml_sees_and_an_nvml_error_after_start_up_counts_none(monkeypatch, caplog):
    """NVML may start and still fail a query (nvmlDeviceGetCount: NVML_ERROR_UNKNOWN): the scheduler's pool set-up
    must not raise (issue 38, item 3)."""
    from tests.support import fake_nvml

    fake = fake_nvml.install(monkeypatch, fake_nvml.FakeNvml(fake_nvml.h200s(2)))
    assert detected_gpus() == 2

    def unknown_error():
        raise fake.NVMLError(fake.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(fake, "nvmlDeviceGetCount", unknown_error)
    with caplog.at_level(logging.WARNING, logger="tf_multiworker.gpu_admission"):
        assert detected_gpus() == 0
    assert f"could not count its GPUs (Unknown Error): none counted; set {SLOTS_SETTING}" in caplog.text
    assert fake.initialised == 0  # shut down again
