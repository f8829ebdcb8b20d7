"""The launch spec, TF_CONFIG and the result, without processes."""

from __future__ import annotations

import json

import pytest

from launcher import (
    FailureKind,
    GroupSpec,
    GroupState,
    PortBindError,
    RunResult,
    WorkerFailedError,
    WorkerFailure,
    WorkerGroupStoppedError,
    WorkerOutcome,
    WorkerSpec,
    WorkerStartupTimeoutError,
    WorkerState,
    build_tf_config,
    error_for,
    tensorflow_env,
)
from launcher.spec import Placement


def test_tf_config_is_exact_json():
    config = build_tf_config(["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"], 1)
    assert json.dumps(config, sort_keys=True) == (
        '{"cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002"]}, '
        '"task": {"index": 1, "type": "worker"}}'
    )


@pytest.mark.parametrize("addresses, rank, message", [
    ([], 0, "at least one worker"),
    (["a:1", "b:2"], 2, "rank 2 is outside the cluster of 2 workers"),
    (["a:1"], -1, "rank -1 is outside"),
])
def test_tf_config_rejects_bad_rank(addresses, rank, message):
    with pytest.raises(ValueError, match=message):
        build_tf_config(addresses, rank)


@pytest.mark.parametrize("changes, message", [
    ({"entrypoint": "trainer/train.py"}, "not a module name"),
    ({"num_workers": 0}, "num_workers must be an integer >= 1"),
    ({"num_workers": True}, "num_workers must be an integer"),
    ({"args": "--config x"}, "args must be a list of strings"),
    ({"startup_timeout_s": 0}, "startup_timeout_s must be a number of seconds > 0"),
    ({"max_launch_attempts": 0}, "max_launch_attempts must be an integer in 1..10"),
    ({"env": {"BAD NAME": "1"}}, "not a valid environment variable name"),
    ({"env": {"A": 1}}, "variable A must be a string"),
    ({"env": {"AWS_SECRET_ACCESS_KEY": "x"}, "secret_env": {"AWS_SECRET_ACCESS_KEY": "y"}}, "both in env and"),
])
def test_group_spec_rejects_bad_settings(changes, message):
    with pytest.raises((TypeError, ValueError), match=message):
        GroupSpec(**{"name": "g", "entrypoint": "trainer.train", **changes})


def test_group_spec_is_frozen_and_hides_secret_values():
    spec = GroupSpec(name="g", entrypoint="trainer.train", args=["--x", "1"], env={"A": "visible"},
                     secret_env={"AWS_SECRET_ACCESS_KEY": "hunter2"})
    with pytest.raises(AttributeError):
        spec.num_workers = 3
    with pytest.raises(TypeError):
        spec.env["B"] = "2"
    shown = repr(spec) + "\n".join(spec.describe())
    assert "hunter2" not in shown
    assert "AWS_SECRET_ACCESS_KEY" in shown and "A=visible" in shown


def _placements(*devices):
    return [Placement("127.0.0.1", 5000 + rank, dev) for rank, dev in enumerate(devices)]


def test_rank_environment_names_rank_and_devices():
    env = tensorflow_env(_placements((3,), (4,)), 0)
    assert json.loads(env["TF_CONFIG"]) == {"cluster": {"worker": ["127.0.0.1:5000", "127.0.0.1:5001"]},
                                            "task": {"type": "worker", "index": 0}}
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["PYTHONUNBUFFERED"] == "1" and "TF_USE_LEGACY_KERAS" not in env
    assert tensorflow_env(_placements((), ()), 1)["CUDA_VISIBLE_DEVICES"] == ""  # CPU: GPUs hidden
    pinned = tensorflow_env(_placements(("GPU-5d1c7c2a-aa44-4b36-9d4f-0c5e4a8b0001",), (4,)), 0)
    assert pinned["CUDA_VISIBLE_DEVICES"] == "GPU-5d1c7c2a-aa44-4b36-9d4f-0c5e4a8b0001"


def test_gpus_scoped_by_the_backend_are_never_hidden():
    """A Kubernetes device plugin gives the pod its GPUs: an empty CUDA_VISIBLE_DEVICES would hide them."""
    env = tensorflow_env(_placements(None, None), 1)
    assert "CUDA_VISIBLE_DEVICES" not in env and "CUDA_DEVICE_ORDER" not in env


@pytest.mark.parametrize("changes, message", [
    ({"port": 0}, "port 0 is outside"),
    ({"host": ""}, "host must not be empty"),
    ({"devices": (-1,)}, "GPU UUIDs .* or indices"),
    ({"devices": ("0",)}, "GPU UUIDs .* or indices"),
])
def test_placement_checks_itself(changes, message):
    with pytest.raises(ValueError, match=message):
        Placement(**{"host": "127.0.0.1", "port": 5000, "devices": (), **changes})


def test_worker_spec_checks_its_rank():
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        WorkerSpec(rank=2, num_workers=2, placement=Placement("h", 1), log_file="l", workdir="w")


def _result(failures, state=GroupState.FAILED):
    workers = tuple(WorkerOutcome(r, "127.0.0.1", 5000 + r, 100 + r, (), WorkerState.FAILED if r in failures
                                  else WorkerState.STOPPED, None) for r in range(3))
    return RunResult("train", state, workers, failures, 1, 4.0, {r: f"/logs/rank-{r}.log" for r in range(3)})


def test_error_names_root_cause_first_with_its_log_tail():
    late = WorkerFailure(0, "127.0.0.1", 100, FailureKind.EXIT_CODE, 1, 3.0, "exited with code 1", ("late",))
    root = WorkerFailure(2, "127.0.0.1", 102, FailureKind.SIGNAL, -9, 1.5, "was killed by SIGKILL (signal 9)",
                         ("step 3", "boom"))
    result = _result({0: late, 2: root})
    message = result.error_message()
    assert not result.succeeded
    assert message.index("rank 2 (host 127.0.0.1, pid 102) was killed by SIGKILL") < message.index("rank 0")
    assert "last lines of rank 2's log (/logs/rank-2.log)" in message and "| boom" in message
    assert "other ranks: rank 1 stopped" in message
    assert isinstance(error_for(result), WorkerFailedError)


def test_error_type_follows_the_root_cause():
    startup = WorkerFailure(1, "h", 1, FailureKind.STARTUP_TIMEOUT, None, 5.0, "did not join", ())
    bind = WorkerFailure(1, "h", 1, FailureKind.PORT_BIND, 1, 0.5, "port in use", ())
    assert isinstance(error_for(_result({1: startup})), WorkerStartupTimeoutError)
    assert isinstance(error_for(_result({1: bind})), PortBindError)
    stopped = error_for(_result({}, GroupState.STOPPED))
    assert isinstance(stopped, WorkerGroupStoppedError) and "stopped from outside" in str(stopped)
