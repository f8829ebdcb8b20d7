"""trainer/preflight/collectives.py: leaving only after every rank's collectives, and the worker port's exposure."""

from __future__ import annotations

import socket

import pytest

from tests.trainer.preflight import workers
from trainer import storage
from trainer.layout import PreflightOutput
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
