"""trainer/preflight/collectives.py: leaving only after every rank's collectives, and the worker port's exposure."""

from __future__ import annotations

import socket

import pytest

from core import storage
from core.config import RunConfig
from core.layout import PreflightOutput
from tests.trainer.preflight import workers
from trainer.allreduce import GradientReducer
from trainer.preflight import collectives, verdict
from trainer.runtime import WorkerIdentity


def test_a_rank_leaves_only_once_every_rank_is_past_its_collectives(tmp_path):
    """No rank may exit while a peer could still read its last collective's data (see wait_for_every_rank): a
    report from the checks only, or one from an earlier attempt, does not count."""
    import threading

    output, me = str(tmp_path / "report"), workers.identity(1, 3)
    earlier_attempt = WorkerIdentity(0, 3, "host-a", ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"))
    this_attempt = verdict.group_id(me)
    storage.write_json_atomic(PreflightOutput(output).rank_report(0), {"group_id": this_attempt})
    storage.write_json_atomic(PreflightOutput(output).rank_report(2),
                                       {"group_id": verdict.group_id(earlier_attempt), "collectives": {}})
    waiter = threading.Thread(target=collectives.wait_for_every_rank, args=(output, me), daemon=True)
    waiter.start()
    for rank in (0, 2):
        waiter.join(0.5)
        assert waiter.is_alive(), f"left before rank {rank} finished its collectives"
        storage.write_json_atomic(PreflightOutput(output).rank_report(rank),
                                           {"group_id": this_attempt, "collectives": {}})
    waiter.join(5)
    assert not waiter.is_alive()


@pytest.mark.parametrize("bind, exposed", [("127.0.0.1", False), ("0.0.0.0", True)])
def test_port_exposure_tells_loopback_from_all_interfaces(bind, exposed):
    if exposed and not workers.non_loopback_addresses():
        pytest.skip("this host has no non-loopback address to reach")
    with socket.socket() as server:
        server.bind((bind, 0))
        server.listen()
        port = server.getsockname()[1]
        identity = WorkerIdentity(0, 2, "host-a", (f"127.0.0.1:{port}", "127.0.0.1:1"))
        result = collectives.port_exposure(identity)
    assert result["port"] == port and result["checked"] == workers.non_loopback_addresses()
    assert result["exposed"] is exposed and bool(result["reachable_on"]) is exposed
    lines = verdict.port_lines({"workers": [{"rank": 0, "host": "host-a", "worker_port": result}]})
    assert lines[0].startswith("WARNING: rank 0 on host-a: worker port") is exposed


@pytest.mark.parametrize("settings, dtype, implementation", [
    ({"use_gpu": True}, "float32", "NCCL"),  # auto with use_gpu
    ({"allreduce_dtype": "bfloat16"}, "bfloat16", "RING"),
])
def test_the_preflight_all_reduces_as_training_will(monkeypatch, settings, dtype, implementation):
    """Every all-reduce of the preflight carries the gradients' wire dtype with the options the gradients' reducer
    builds (one builder, trainer.allreduce.communication_options), so a pair the collective cannot carry fails the
    preflight rather than training's first step. On the default strategy (one replica, CPU): NCCL itself needs a GPU,
    the options it would get are what is checked."""
    import tensorflow as tf

    cfg, passed = RunConfig(**settings), []
    real_all_reduce = tf.distribute.ReplicaContext.all_reduce

    def recording_all_reduce(self, reduce_op, value, options=None):
        passed.append((value.dtype.name, options))
        return real_all_reduce(self, reduce_op, value, options=options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", recording_all_reduce)
    results = collectives.run_collectives(tf.distribute.get_strategy(), 0, 1, cfg)
    training = GradientReducer(cfg)._options
    expected = getattr(tf.distribute.experimental.CommunicationImplementation, implementation)
    assert passed and all(wire == dtype and options.implementation == training.implementation == expected
               for wire, options in passed), passed
    assert results["all_reduce"] == {"expected": [1.0], "got": [1.0], "ok": True, "wrong_ranks": [], "dtype": dtype,
                                     "implementation": implementation.lower()}
    assert results["bandwidth"]["ok"] and results["latency"]["bytes"] == tf.as_dtype(dtype).size


def test_a_collective_that_cannot_carry_the_pair_fails_the_preflight_naming_the_settings(tmp_path, monkeypatch):
    """What the preflight says when the all-reduce fails as training's would (NCCL refusing the wire dtype reads
    "InternalError: Collective ... expected data types compatible with NCCL"): the phase names both settings."""
    import tensorflow as tf

    def nccl_refuses(*args):
        raise tf.errors.InternalError(None, None, "Collective 1 expected data types compatible with NCCL")

    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setattr(collectives, "create_strategy", lambda *args, **kwargs: tf.distribute.get_strategy())
    monkeypatch.setattr(collectives, "port_exposure", lambda identity: {})
    monkeypatch.setattr(collectives, "run_collectives", nccl_refuses)
    scratch = str(tmp_path)
    exit_code = collectives.collectives_main(scratch, RunConfig(use_gpu=True), str(tmp_path / "report"))
    assert exit_code == verdict.EXIT_COLLECTIVES_FAILED
    phase = (tmp_path / collectives.PHASE_FILE).read_text()
    assert phase.startswith("all-reduce of float32 over nccl (as training: settings 'allreduce_dtype' and "
                            "'communication')"), phase
    error = storage.read_json(str(tmp_path / collectives.RESULT_FILE))["error"]
    assert error == "InternalError: Collective 1 expected data types compatible with NCCL"
