"""Each pod's status and log as the group sees them (kubernetes_pods.py), through the kubernetes backend against
tests/support/k8s_server.py: a dropped log stream, a pod killed mid-run, a pod that stays Pending, an image that
cannot be pulled."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from launcher import FailureKind, GroupState
from launcher.kubernetes_objects import GroupNames
from tests.launcher.test_kubernetes import RUN_KEY, backend, image_env, run, spec
from tests.support.k8s_server import FakeKubernetes


@pytest.fixture
def cluster(tmp_path):
    with FakeKubernetes(image_env(tmp_path)) as fake:
        yield fake


def test_a_dropped_log_stream_reconnects_without_repeating_a_line(cluster, tmp_path):
    cluster.cut_log_streams_after(2)
    result, _, lines = run(spec(env={"TINY_WORKER_STEPS": "12", "TINY_WORKER_STEP_S": "0.1"}), backend(cluster),
                           tmp_path)
    assert result.succeeded, result.error_message()
    for rank in (0, 1):
        mine = [line for r, line in lines if r == rank and " step " in line]
        assert mine == [f"rank {rank} step {s} done" for s in range(12)], mine


def test_a_pod_killed_mid_run_fails_the_group_naming_the_pod(cluster, tmp_path):
    names = GroupNames(RUN_KEY, "tiny", "default")
    killer = threading.Thread(target=_kill_when_running, args=(cluster, names.pod(0)), daemon=True)
    killer.start()
    result, _, _ = run(spec(env={"TINY_WORKER_STEPS": "400", "TINY_WORKER_STEP_S": "0.05"}), backend(cluster),
                       tmp_path)
    message = result.error_message()
    print(f"\npod 0 SIGKILLed:\n{message}")
    assert result.state is GroupState.FAILED and 0 in result.failures
    assert "SIGKILL" in message and names.pod(0) in message
    assert f"pod {names.pod(0)} on node {cluster.node_name} ended Failed: exit code 137" in message
    assert cluster.remaining() == {}


def _kill_when_running(cluster: FakeKubernetes, pod: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if b"step 3 done" in cluster.log_of(pod):
            cluster.kill_pod_process(pod, signal.SIGKILL)
            return
        time.sleep(0.05)


def test_a_pod_that_stays_pending_fails_at_the_startup_timeout_with_its_events(cluster, tmp_path):
    cluster.hold_pending("*-1", message="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    result, wall_s, _ = run(spec(startup_timeout_s=4), backend(cluster), tmp_path)
    message = result.error_message()
    print(f"\npod 1 Pending: failed after {wall_s:.2f} s\n{message}")
    assert result.failures[1].kind is FailureKind.STARTUP_TIMEOUT
    assert "FailedScheduling: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu." in message
    assert f"never started: pod {GroupNames(RUN_KEY, 'tiny', 'default').pod(1)} is Pending: Unschedulable" in message
    assert 4 <= wall_s < 15
    assert cluster.remaining() == {}


def test_an_image_that_cannot_be_pulled_is_named_with_its_event(cluster, tmp_path):
    cluster.hold_pending("*", reason="ErrImagePull", message='rpc error: pull access denied for "nope:1"')
    result, _, _ = run(spec(startup_timeout_s=3), backend(cluster), tmp_path)
    assert "ErrImagePull" in result.error_message() and "pull access denied" in result.error_message()
    assert cluster.remaining() == {}
