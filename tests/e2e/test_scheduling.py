"""Scheduling on a real Airflow started as `make airflow` starts it (scripts/standalone.sh): a task whose first calls
to the execution API find no server answering, and GPU admission through the gpu_slots pool.

The DAGs are in tests/e2e/harness_dags/scheduling.py. Tasks reach the execution API through a TCP proxy in front
of the API server that resets the first DROPPED connections, as a server that is still starting refuses them.
"""

from __future__ import annotations

import socket
import struct
import threading
import urllib.parse
from datetime import datetime
from pathlib import Path

import pytest
from tf_multiworker.gpu_admission import GPU_POOL

from tests.support.airflow_stack import free_port, start_stack

pytestmark = pytest.mark.timeout(1500)

HARNESS_DAGS = Path(__file__).resolve().parent / "harness_dags"
POOL_SIZE = 3  # a fake GPU count: two runs of 2 workers each need 4 slots
DROPPED = 6  # more connections than the attempts Airflow's task client makes by default (5)


class ResettingProxy:
    """Forwards 127.0.0.1:<port> to the API server, after resetting the first `drop_first` connections."""

    def __init__(self, target_port: int, drop_first: int):
        self.target_port, self.drop_first, self.dropped = target_port, drop_first, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            if self.dropped < self.drop_first:
                self.dropped += 1
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
                client.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("airflow_home")
    port = free_port()
    proxy = ResettingProxy(port, DROPPED)
    stack = start_stack(
        home, {"GPT_FINETUNE_STORAGE_ROOT": str(tmp_path_factory.mktemp("storage")),
               "GPT_FINETUNE_GPU_SLOTS": str(POOL_SIZE)},
        port=port, timeout=600,
        overrides={"AIRFLOW__CORE__DAGS_FOLDER": str(HARNESS_DAGS),
                   "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{proxy.port}/execution/"},
    )
    stack.proxy = proxy
    try:
        yield stack
    finally:
        stack.stop()
        proxy.close()


def trigger(stack, dag_id: str, conf: dict | None = None) -> str:
    run = stack.rest("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
    return run["dag_run_id"]


def task_instance(stack, dag_id: str, run_id: str, task_id: str) -> dict:
    return stack.rest("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
                             f"/taskInstances/{task_id}")


# First in this module: the proxy resets only the first connections, whichever task makes them.
def test_a_task_that_finds_no_execution_api_waits_for_it_instead_of_failing(stack):
    stack.wait_for_dag("api_start_harness", timeout=600)
    run_id = trigger(stack, "api_start_harness")
    assert stack.wait_for_run("api_start_harness", run_id, timeout=400) == "success"
    assert stack.proxy.dropped == DROPPED  # the task's first DROPPED calls failed, and it went on


def test_gpu_runs_that_need_more_slots_than_the_pool_has_take_turns(stack):
    assert stack.rest("GET", f"/api/v2/pools/{GPU_POOL}")["slots"] == POOL_SIZE  # from GPT_FINETUNE_GPU_SLOTS
    stack.wait_for_dag("gpu_admission_harness", timeout=600)
    conf = {"use_gpu": True, "num_workers": 2}
    runs = [trigger(stack, "gpu_admission_harness", conf) for _ in range(2)]
    for run_id in runs:
        assert stack.wait_for_run("gpu_admission_harness", run_id, timeout=600) == "success"

    groups = sorted((task_instance(stack, "gpu_admission_harness", run_id, "train") for run_id in runs),
                    key=lambda ti: ti["start_date"])
    first, second = groups
    print("train groups (start, end):", [(ti["start_date"], ti["end_date"]) for ti in groups])
    assert datetime.fromisoformat(first["end_date"]) <= datetime.fromisoformat(second["start_date"]), (
        f"both groups ran at once: {[(ti['start_date'], ti['end_date']) for ti in groups]}")
    assert [(ti["pool"], ti["pool_slots"]) for ti in groups] == [(GPU_POOL, 2)] * 2
    assert "requires 2 slots but there are 1 open slots in the pool gpu_slots" in stack.log_path.read_text()
