"""Waiting for admission (issue 40, item 1): the GPU tasks' scheduled -> queued time, read from Airflow's REST API
through a connection (tasks/ledger/airflow_api.py, here against a small stand-in server with Airflow 3.3's routes and
fields), is shown as `waited`, costs nothing, and is never also counted as held time between tasks
(tasks/ledger/usage.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import ClassVar

import pytest

from tasks.ledger import airflow_api, usage
from tasks.ledger.usage import AttemptEvents
from tasks.report.parts import run_view
from tasks.report.store import render_markdown
from tests.support.http import send_json
from tests.tasks.ledger.test_usage import assert_invariants, attempt, causes, rank
from tests.tasks.report.test_store import document

# preflight 0-10 and train 40-80 on two slots, evaluate 100-110 on one, released at 120.
TIMELINE = [
    attempt("preflight", rank(0, 0, 5, 10), rank(1, 0, 5, 10)),
    attempt("train", rank(0, 40, 45, 80, 50, 75), rank(1, 40, 45, 80, 50, 75)),
    attempt("evaluate", rank(0, 100, 102, 110)),
]


def test_an_admission_wait_between_groups_is_waited_not_held_and_the_invariants_hold():
    """train waited for its pool slots 12 -> 37 (another run held them): those 25 s are not this run's on either
    slot; the gaps' other seconds stay between tasks. evaluate's wait 85 -> 95 is carved from the gap of the slot it
    runs on next."""
    held = usage.ledger(TIMELINE, released_at=120)
    book = usage.ledger(TIMELINE, released_at=120, not_held=[(-30, -5), (12, 37), (85, 95)])
    assert_invariants(book)
    # rank 1's slot ran nothing after train (exit 80): from there to release it is the release tail, not a gap
    for slot, waited in (("h/rank0", 35), ("h/rank1", 25)):
        assert book.slots[slot].waited_s == waited
        assert book.slots[slot].held_s == held.slots[slot].held_s - waited
        assert causes(book, slot)["between_tasks"] == causes(held, slot)["between_tasks"] - waited
    assert book.busy_s == held.busy_s and book.waited_s == 60
    # a wait before the first launch (-30 -> -5) was never held: nothing to take out


def test_a_wait_never_takes_a_second_a_group_covers_or_the_release_tail():
    """A wait that overlaps another group's run on the same slot, or the time after the slot's last exit, removes
    nothing there: a second is waited only when no group of the run was on the slot and it was before its last exit."""
    held = usage.ledger(TIMELINE, released_at=120)
    book = usage.ledger(TIMELINE, released_at=120, not_held=[(41, 79), (111, 119)])
    assert_invariants(book)
    assert book.held_s == held.held_s and book.waited_s == 0
    tail = usage.ledger(TIMELINE, released_at=120, not_held=[(90, 120)])  # rank1's last exit is 80: release after
    assert tail.slots["h/rank1"].waited_s == 0 and tail.slots["h/rank0"].waited_s == 10  # 90 -> 100


def test_admission_waits_read_airflows_try_fields():
    tries = [
        {"task_id": "train", "try_number": 1, "map_index": -1, "scheduled_when": "2026-12-05T00:00:10+00:00",
         "queued_when": "2026-12-05T00:00:40.5+00:00", "start_date": "2026-12-05T00:00:41+00:00"},
        {"task_id": "train", "try_number": 2, "map_index": -1, "scheduled_when": None, "queued_when": None,
         "start_date": None},  # never admitted: left out
        {"task_id": "evaluate", "try_number": 1, "map_index": -1, "scheduled_when": "2026-12-05T00:01:00+00:00",
         "queued_when": "2026-12-05T00:01:00.25+00:00", "start_date": None},
    ]
    waits = airflow_api.admission_waits([airflow_api.TaskTry.from_api(row, "/tries") for row in tries])
    assert [(w.task_id, w.waited_s, w.queued_s) for w in waits] == [("train", 30.5, 0.5), ("evaluate", 0.25, None)]
    assert (waits[0].try_number, waits[0].map_index, waits[0].started - waits[0].scheduled) == (1, -1, 31.0)


class FakeApi(BaseHTTPRequestHandler):
    """Airflow 3.3's token route (simple auth manager) and the tries route, nothing else."""

    tries: ClassVar[dict[str, list[dict]]] = {}
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def log_message(self, *args) -> None:
        pass

    def _answer(self, code: int, body: dict) -> None:
        send_json(self, code, body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/auth/token" and body == {"username": "reader", "password": "s3cret"}:
            self._answer(201, {"access_token": "jwt-1"})
        else:
            self._answer(401, {"detail": "Invalid credentials"})

    def do_GET(self) -> None:
        FakeApi.seen.append((self.path, self.headers.get("Authorization")))
        prefix = "/api/v2/dags/gpt_finetune/dagRuns/manual__2026-12-05T00%3A00%3A00%2B00%3A00/taskInstances/"
        if self.headers.get("Authorization") != "Bearer jwt-1":
            self._answer(401, {"detail": "Not authenticated"})
        elif self.path.startswith(prefix) and self.path.endswith("/tries"):
            rows = FakeApi.tries.get(self.path[len(prefix):-len("/tries")], [])
            self._answer(200, {"task_instances": rows, "total_entries": len(rows)})
        else:
            self._answer(404, {"detail": "Not Found"})


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    FakeApi.seen = []
    yield server
    server.shutdown()


def connection(server, password="s3cret", **changes):
    values = {"conn_id": "gpt_finetune_api", "host": "127.0.0.1", "port": server.server_address[1], "schema": "http",
              "login": "reader", "password": password}
    return SimpleNamespace(**{**values, **changes})


def try_row(task_id, **changes):
    """A try as Airflow 3.3's tries route lists it (a few of its fields; the others are not read)."""
    return {"task_id": task_id, "dag_id": "gpt_finetune", "try_number": 1, "map_index": -1, "state": "success",
            "scheduled_when": "2026-12-05T00:00:10+00:00", "queued_when": "2026-12-05T00:00:40+00:00",
            "start_date": "2026-12-05T00:00:41+00:00", "operator": "TFMultiWorkerOperator", **changes}


@pytest.mark.parametrize("row,field", [({"try_number": "1"}, "TaskTry.try_number"),
                                       ({"queued_when": "yesterday"}, "TaskTry.queued_when"),
                                       ({"map_index": None}, "TaskTry.map_index")])
def test_a_try_of_another_shape_is_refused_naming_the_endpoint_and_the_field(api, row, field):
    FakeApi.tries = {"train": [try_row("train"), try_row("train", **row)]}
    run_id = "manual__2026-12-05T00:00:00+00:00"
    with pytest.raises(airflow_api.ApiUnavailable) as refused:
        airflow_api.task_tries("gpt_finetune", run_id, ["train"], connection=connection(api))
    assert "/taskInstances/train/tries task_instances[1]" in str(refused.value) and field in str(refused.value)


def test_the_tries_of_each_task_are_read_with_a_token_and_errors_never_name_the_password(api):
    FakeApi.tries = {"train": [try_row("train")], "preflight": [try_row("preflight", queued_when=None)]}
    run_id = "manual__2026-12-05T00:00:00+00:00"
    rows = airflow_api.task_tries("gpt_finetune", run_id, ["train", "preflight", "train"], connection=connection(api))
    assert sorted(row.task_id for row in rows) == ["preflight", "train"]
    assert rows[1].scheduled_when == "2026-12-05T00:00:10+00:00" and rows[0].queued_when is None
    assert all(auth == "Bearer jwt-1" for _, auth in FakeApi.seen) and len(FakeApi.seen) == 2
    with pytest.raises(airflow_api.ApiUnavailable) as refused:
        airflow_api.task_tries("gpt_finetune", run_id, ["train"], connection=connection(api, password="wrong"))
    assert "/auth/token answered HTTP 401" in str(refused.value) and "wrong" not in str(refused.value)
    with pytest.raises(airflow_api.ApiUnavailable, match="has no login"):
        airflow_api.task_tries("gpt_finetune", run_id, ["train"], connection=connection(api, login=""))
    assert airflow_api.base_url(connection(api, host="https://api.example:8443/", port=None)) == \
        "https://api.example:8443"


def test_without_the_connection_waited_is_null_and_the_report_says_why(tmp_path, monkeypatch):
    from tasks.ledger import record as usage_record

    monkeypatch.setattr(airflow_api, "task_tries", lambda *a, **k: (_ for _ in ()).throw(airflow_api.ApiUnavailable(
        "no Airflow connection 'gpt_finetune_api' (AirflowNotFoundException): add one ...")))
    attempts = [AttemptEvents(group="train", backend="local", attempt=1, try_number="1", state="succeeded", ranks=())]
    waits = usage_record.admission(attempts, "gpt_finetune", "manual__1")
    assert waits.waits is None and "no Airflow connection 'gpt_finetune_api'" in waits.note
    assert usage_record.admission([], "gpt_finetune", "manual__1").note == "no GPU task recorded"

    summary = {"unit": "worker_hour", "slots": 2, "held_gpu_h": 0.01, "busy_gpu_h": 0.005, "idle_gpu_h": 0.005,
               "idle_by_cause_gpu_h": {}, "busy_share": 0.5, "time_to_release_s": 1.0, "per_slot": [],
               "attempts": [], "price": None, "cost": None, "waited_s": None, "waited_note": waits.note}
    page = render_markdown(run_view(document(), None, {"usage": summary}))
    assert ("Waited for admission in Airflow: unknown (not measured: no Airflow connection 'gpt_finetune_api'"
            in page)
    measured = render_markdown(run_view(document(), None,
                                        {"usage": {**summary, "waited_s": 30.5, "waited_gpu_h": 0.0097}}))
    assert "(scheduled to queued, every try of the GPU tasks): 30.5 s, not charged; 0.0097 slot-h" in measured
