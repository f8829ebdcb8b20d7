"""DAGs for tests/e2e/test_scheduling.py, run by a real scheduler whose DAGs folder is this one.

gpu_admission_harness: one worker group declared as gpt_finetune declares its GPU tasks (pool=GPU_POOL, num_workers
from the run's configuration, the run's `use_gpu` and `num_workers` Params), so the GPU admission policy gives it
num_workers slots of the pool in a run with use_gpu. Its workers only sleep: the operator's own use_gpu stays off
because a CPU machine has no GPU to pin; what is under test is the pool, which the scheduler enforces the same either
way.

api_start_harness: one task that only returns, to watch how it reaches the execution API.
"""

from __future__ import annotations

import os
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Param, task
from tf_multiworker.gpu_admission import GPU_POOL
from tf_multiworker.operator import TFMultiWorkerOperator

REPO = Path(__file__).resolve().parents[3]
START = pendulum.datetime(2026, 1, 1, tz="UTC")

with DAG("gpu_admission_harness", schedule=None, start_date=START, render_template_as_native_obj=True,
         params={"use_gpu": Param(False, type="boolean"), "num_workers": Param(2, type="integer", minimum=1)}):
    TFMultiWorkerOperator(
        task_id="train",
        entrypoint="tiny_worker",
        args=[],
        # Nested templates render too: the group follows the run's num_workers, as gpt_finetune's groups do.
        run_config={"num_workers": "{{ params.num_workers }}", "use_gpu": False,
                    "storage_root": os.environ["GPT_FINETUNE_STORAGE_ROOT"]},
        run_key="{{ run_id | replace(':', '_') | replace('+', '_') }}",
        env={"PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "launcher" / "entrypoints"), str(REPO)]),
             "TINY_WORKER_STEPS": "60", "TINY_WORKER_STEP_S": "0.25"},
        pool=GPU_POOL,
        retries=0,
    )

with DAG("api_start_harness", schedule=None, start_date=START):

    @task(retries=0)
    def reach_the_api() -> str:
        return "reached"

    reach_the_api()
