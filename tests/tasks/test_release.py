"""Release ends every process of the run (recorded or not, stubborn or not), proves it, and is idempotent."""

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tf_multiworker.backends import make_backend

from core.layout import PROMOTION_JSON, StorageLayout, run_key
from core.protocol import LAUNCHER_WORKDIR_PREFIX
from core.storage import join, write_json_atomic
from launcher.host_identity import host_identity
from tasks.release import ReleaseError, processes_of_run, release_run
from tests.support.hardware import assert_gpu_check_matches_this_machine

RUN_ID = "manual__2026-11-29T02:00:00+00:00"
DAG_ID = "gpt_finetune"
KEY = run_key(DAG_ID, RUN_ID)

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
WITH_CHILD = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
)


def start(code: str, key: str = KEY, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, TFMW_RUN_KEY=key)
    return subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True, **kwargs)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def state_record(**fields) -> dict:
    """A run-state record as a launch writes it (launcher/state_record.py), with `fields` given."""
    return {"task_id": "train", "backend": "local", "state": "failed", "updated_at": "2026-11-29T02:05:00.000Z",
            "workdir": "", "workers": [], **fields}


@pytest.fixture
def processes():
    started = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


def test_release_ends_recorded_unrecorded_stubborn_and_grandchildren(tmp_path, processes):
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    recorded = start("import time; time.sleep(600)")
    stubborn = start(STUBBORN)
    parent = start(WITH_CHILD)
    other_run = start("import time; time.sleep(600)", key="some_other_run")
    processes += [recorded, stubborn, parent, other_run]
    workdir = Path(tempfile.mkdtemp(prefix=f"{LAUNCHER_WORKDIR_PREFIX}train-"))
    write_json_atomic(run.state_file("train"), state_record(
        workdir=str(workdir), launcher=host_identity(),
        workers=[{"rank": 0, "host": "localhost", "pid": recorded.pid, "pgid": recorded.pid, "port": 1, "gpus": []}]))
    assert wait_for(lambda: len(processes_of_run(KEY)) == 4)  # recorded, stubborn, parent and its child

    started = time.monotonic()
    result = release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend, grace_period_s=2.0)
    elapsed = time.monotonic() - started

    assert result["clean"] is True
    assert processes_of_run(KEY) == {}
    assert stubborn.pid in result["killed"]  # ignored SIGTERM, needed SIGKILL after the grace period
    assert elapsed < 10
    assert other_run.poll() is None  # another run's worker is untouched
    assert not workdir.exists()
    report = json.loads(Path(run.release).read_text())
    assert report["state_records"] == ["train.json"]
    assert report["clean"] and report["survivors"] == [] and report["unverified_records"] == []
    assert report["host_identity"] == host_identity()
    assert_gpu_check_matches_this_machine(report["gpu_check"])


def _elsewhere(how: str) -> dict | None:
    """The launcher identity of a record written on another machine, in another container of this one (its own
    PID and mount namespaces), or by a version that did not record it."""
    here = host_identity()
    return {"machine": {**here, "hostname": "gpu-host-7", "boot_id": "0f0e0d0c-0000-4000-8000-000000000007"},
            "container": {**here, "pid_namespace": "pid:[4026532999]", "mount_namespace": "mnt:[4026532998]"},
            "unrecorded": None}[how]


@pytest.mark.parametrize("how", ["machine", "container", "unrecorded"])
def test_a_local_record_from_another_host_is_never_clean(tmp_path, processes, how):
    """Release here cannot see another host's (or container's) processes, work directory or GPUs: a local group
    launched there is reported unverified, naming both hosts and the setting, and the run is not released. This
    host's own processes are still ended, and the other host's pids are never looked for here."""
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    mine = start("import time; time.sleep(600)")
    processes.append(mine)
    bystander = start("import time; time.sleep(600)", key="not_this_run")  # the other host's pid, reused here
    processes.append(bystander)
    launcher = _elsewhere(how)
    write_json_atomic(run.state_file("train"), state_record(
        state="running", workdir="/tmp/tfmw-train-elsewhere", **({"launcher": launcher} if launcher else {}),
        workers=[{"rank": 0, "host": "127.0.0.1", "pid": bystander.pid, "pgid": bystander.pid, "port": 1,
                  "gpus": [0]}]))
    write_json_atomic(run.state_file("preflight"), state_record(task_id="preflight", state="succeeded",
                                                                launcher=host_identity()))
    assert wait_for(lambda: mine.pid in processes_of_run(KEY))

    with pytest.raises(ReleaseError) as raised:
        release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend, grace_period_s=1.0)

    message = str(raised.value)
    print(f"\n{how}: {message}")
    here = host_identity()
    assert "Unverified: state record train.json" in message and "set gpu_queue" in message
    assert f"release runs on {here['hostname']} " in message
    assert ("gpu-host-7 (boot 0f0e0d0c" in message if how == "machine" else
            "pid:[4026532999]" in message if how == "container" else "an unknown host" in message)
    report = json.loads(Path(run.release).read_text())
    assert report["clean"] is False and report["unverified_records"] == ["train.json"]
    entry = next(host for host in report["hosts"] if host.get("state_record") == "train.json")
    assert entry["backend"] == "local" and entry["host"] == ("gpu-host-7" if how == "machine" else
                                                             here["hostname"] if how == "container" else "unknown")
    assert entry["unverified"].startswith("state record train.json (state running) is a local group launched on")
    assert mine.pid in report["terminated"] + report["killed"]  # this host's part was done all the same
    assert bystander.poll() is None  # the other host's pid means nothing here


def test_release_is_idempotent_and_survives_invalid_settings(tmp_path):
    root = str(tmp_path / "storage")
    params = {"storage_root": root, "num_workers": 0, "bogus": 1}  # the run that prepare refused
    first = release_run(params, RUN_ID, DAG_ID, make_backend)
    second = release_run(params, RUN_ID, DAG_ID, make_backend)
    assert first["clean"] and second["clean"]
    assert first["terminated"] == second["terminated"] == []
    assert os.path.exists(StorageLayout(root).run(KEY).release)


def test_unreleasable_process_fails_the_task(tmp_path, processes, monkeypatch):
    proc = start("import time; time.sleep(600)")
    processes.append(proc)
    assert wait_for(lambda: proc.pid in processes_of_run(KEY))
    # A process that cannot be signalled.
    monkeypatch.setattr("launcher.process.signal_pids", lambda pids, sig: [])
    with pytest.raises(ReleaseError, match=f"still alive: pid {proc.pid} "):
        release_run({"storage_root": str(tmp_path)}, RUN_ID, DAG_ID, make_backend, grace_period_s=0.5)


@pytest.mark.parametrize("named", ["/", "home", "not-ours", "symlink"])
def test_release_deletes_only_the_launchers_own_temporary_directories(tmp_path, processes, named):
    """A state record is storage content: a workdir naming /, $HOME or any other path is never deleted."""
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    decoy = Path(tempfile.mkdtemp(prefix="not-tfmw-"))
    target = Path(tempfile.mkdtemp(prefix=f"{LAUNCHER_WORKDIR_PREFIX}decoy-"))
    link = Path(tempfile.gettempdir(), f"{LAUNCHER_WORKDIR_PREFIX}link-{os.getpid()}")
    link.symlink_to(decoy)
    try:
        workdir = {"/": "/", "home": str(Path.home()), "not-ours": str(decoy), "symlink": str(link)}[named]
        worker = start("import time; time.sleep(600)")
        processes.append(worker)
        write_json_atomic(run.state_file("train"), state_record(
            workdir=workdir, launcher=host_identity(),
            workers=[{"rank": 0, "host": "localhost", "port": 1, "pid": worker.pid}]))
        assert wait_for(lambda: worker.pid in processes_of_run(KEY))

        result = release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend, grace_period_s=1.0)

        assert result["clean"] and worker.pid in result["terminated"] + result["killed"]
        assert json.loads(Path(run.release).read_text())["removed_dirs"] == []
        assert Path(workdir).exists() and decoy.exists() and target.exists()
    finally:
        link.unlink()
        decoy.rmdir()
        target.rmdir()


def test_a_malformed_state_record_never_stops_the_kills_and_is_unverified_never_clean(tmp_path, processes, caplog):
    """A record that is not one is skipped, naming the file and the field; the run's processes are still ended. The
    process scan sees this host only, so release cannot vouch for what such a record named (review t5, finding 4:
    it was released clean)."""
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    worker = start("import time; time.sleep(600)")
    processes.append(worker)
    Path(run.state).mkdir(parents=True)
    Path(run.state, "train.json").write_text('{"workers": [{"pid": "not a pid"}], "workdir": 7}')
    Path(run.state, "preflight.json").write_text("[1, 2")
    write_json_atomic(run.state_file("baseline"), state_record(
        task_id="baseline", workers=[{"rank": "0", "host": "localhost", "port": 1, "pid": worker.pid}]))
    write_json_atomic(run.state_file("evaluate"), state_record(task_id="evaluate", backend="elsewhere"))
    assert wait_for(lambda: worker.pid in processes_of_run(KEY))

    with caplog.at_level(logging.WARNING, logger="gpt_finetune.release"), \
            pytest.raises(ReleaseError, match=r"is not fully released: Unverified: state record baseline.json cannot "
                                              r"be read \(.*workers\[0\].rank: expected int"):
        release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend, grace_period_s=1.0)

    release = json.loads(Path(run.release).read_text())
    assert worker.pid in release["terminated"] + release["killed"] and release["clean"] is False
    assert sorted(release["state_records"]) == sorted(release["unverified_records"]) == [
        "baseline.json", "evaluate.json", "preflight.json", "train.json"]
    assert "train.json is malformed" in caplog.text and "missing key(s) task_id" in caplog.text
    assert "baseline.json is malformed" in caplog.text and "workers[0].rank: expected int" in caplog.text
    assert "evaluate.json is malformed" in caplog.text and "backend: 'elsewhere' is none of local" in caplog.text


def test_release_ends_the_processes_before_failing_on_unreachable_storage(tmp_path, processes):
    """Storage is read after the kills: an unreachable store fails the task, naming what was ended."""
    blocker = tmp_path / "storage"
    blocker.write_text("a file where the storage root's directory should be")
    worker = start("import time; time.sleep(600)")
    processes.append(worker)
    assert wait_for(lambda: worker.pid in processes_of_run(KEY))

    with pytest.raises(ReleaseError, match=r"could not be recorded: .*1 terminated.*still alive: none"):
        release_run({"storage_root": str(blocker)}, RUN_ID, DAG_ID, make_backend, grace_period_s=2.0)
    assert processes_of_run(KEY) == {}


def test_release_writes_its_own_record_beside_the_report_and_renders_report_md_from_all_three_parts(tmp_path):
    """One writer per file: release writes release.json beside report.json and promotion.json, leaves both as
    evaluate and promote wrote them, and is report.md's one writer: the merge of all three parts."""
    from tasks.report.parts import read_parts, run_view
    from tasks.report.store import REPORT_MD
    from tests.tasks.report.test_store import document_of
    from tests.tasks.report.test_store import report as sample_report

    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    write_json_atomic(run.report_json, sample_report())
    write_json_atomic(join(run.report, PROMOTION_JSON), {
        "promoted": False, "policy": "auto", "model_name": "gpt_finetune", "reason": "worse than the promoted version",
        "compared_with": None, "version": None, "url": None, "model_url": None, "event": None,
        "decided_at": "2026-11-29T10:05:00+00:00", "export_gates": [], "exports": {}})
    evaluated, decided = Path(run.report_json).read_bytes(), Path(run.report, PROMOTION_JSON).read_bytes()
    assert not Path(run.report, REPORT_MD).exists()

    release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend)

    assert (Path(run.report_json).read_bytes(), Path(run.report, PROMOTION_JSON).read_bytes()) == (evaluated, decided)
    assert Path(run.release).parent == Path(run.report_json).parent
    view = run_view(document_of(json.loads(evaluated)), *read_parts(run.report))
    assert view.release["clean"] is True and view.release["survivors"] == [] and view.released == "yes"
    markdown = Path(run.report, REPORT_MD).read_text()
    assert markdown.startswith("# GPT fine-tune run `manual__1`")  # report.json's
    assert "**Not promoted** (policy 'auto'): worse than the promoted version" in markdown  # promotion.json's
    assert "**Released: yes**" in markdown  # release.json's


def test_release_of_one_run_leaves_a_lookalike_runs_workers_running(tmp_path, processes):
    """Two run ids that sanitize to the same text get different keys, so one release never sweeps the other."""
    lookalike_id = RUN_ID.replace(":", "_").replace("+", "_")
    other_key = run_key(DAG_ID, lookalike_id)
    assert other_key != KEY
    mine, other = start("import time; time.sleep(600)"), start("import time; time.sleep(600)", key=other_key)
    processes += [mine, other]
    assert wait_for(lambda: mine.pid in processes_of_run(KEY) and other.pid in processes_of_run(other_key))

    result = release_run({"storage_root": str(tmp_path)}, RUN_ID, DAG_ID, make_backend, grace_period_s=1.0)

    assert mine.pid in result["terminated"] + result["killed"]
    assert other.poll() is None and other.pid in processes_of_run(other_key)


def test_a_gpu_release_cannot_vouch_for_is_named_in_the_failure(tmp_path, processes, monkeypatch):
    """NVML lists a host pid beside the run's worker (a driver that reports host pids in a container): release
    ends the worker yet cannot tell the GPU free, fails, and names the host, the GPU and why (issue 38, 2b)."""
    from tests.support import fake_nvml

    fake = fake_nvml.install(monkeypatch, fake_nvml.FakeNvml(fake_nvml.h200s(1)))
    proc = start("import time; time.sleep(600)")
    processes.append(proc)
    assert wait_for(lambda: proc.pid in processes_of_run(KEY))
    fake.attach(proc.pid, 0, 8 << 30)
    fake.start_process(0, 1 << 30, pid=4_000_001, listed_pid=4_000_001)
    with pytest.raises(ReleaseError, match=r"GPUs not verified free: \S+ GPU 0 \(GPU-00000000-\S+\): NVML lists "
                                           r"pid\(s\) \[4000001\], which are no process of this PID namespace"):
        release_run({"storage_root": str(tmp_path)}, RUN_ID, DAG_ID, make_backend, grace_period_s=0.5)
    assert proc.wait(timeout=10) is not None


def _record_of(worker: subprocess.Popen, **fields) -> dict:
    return state_record(launcher=host_identity(), workers=[{"rank": 0, "host": "localhost", "port": 1,
                                                            "pid": worker.pid}], **fields)


@pytest.mark.parametrize("edit", ["mistyped", "backend renamed", "deleted"])
def test_a_state_record_edited_in_storage_is_unverified_never_released_clean(tmp_path, processes, edit):
    """Review t5, finding 4: one mistyped field, a renamed backend or a deleted record turned a local group launched
    on another GPU host from unverified into "released clean". The operator's XCom copy names it still."""
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    worker = start("import time; time.sleep(600)")
    processes.append(worker)
    pushed = {"train": _record_of(worker, task_id="train"), "preflight": None}
    edited = {"mistyped": {**pushed["train"], "workdir": 7}, "backend renamed": {**pushed["train"], "backend": "x"},
              "deleted": None}[edit]
    Path(run.state).mkdir(parents=True)
    if edited is not None:
        write_json_atomic(run.state_file("train"), edited)
    assert wait_for(lambda: worker.pid in processes_of_run(KEY))

    with pytest.raises(ReleaseError, match="Unverified: state record train.json"):
        release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend, grace_period_s=1.0, pushed=pushed)
    release = json.loads(Path(run.release).read_text())
    assert release["clean"] is False and release["unverified_records"] == ["train.json"]
    assert worker.pid in release["terminated"] + release["killed"]
    why = {"mistyped": "cannot be read", "backend renamed": "cannot be read",
           "deleted": "is missing from storage, though the operator pushed it to XCom"}[edit]
    assert why in release["hosts"][-1]["unverified"]


def test_a_state_record_rewritten_to_name_other_workers_than_xcom_is_unverified(tmp_path, processes):
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run(KEY)
    worker = start("import time; time.sleep(600)")
    processes.append(worker)
    pushed = _record_of(worker, task_id="train")
    write_json_atomic(run.state_file("train"), {**pushed, "workers": [], "state": "succeeded"})
    assert wait_for(lambda: worker.pid in processes_of_run(KEY))
    with pytest.raises(ReleaseError, match="state record train.json differs from the copy the operator pushed"):
        release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend, grace_period_s=1.0,
                    pushed={"train": pushed})
    # The same record, only moved on in state and time after the push, is the group's own.
    write_json_atomic(run.state_file("train"), {**pushed, "state": "succeeded", "updated_at": "2026-11-29T03:00Z"})
    assert release_run({"storage_root": root}, RUN_ID, DAG_ID, make_backend, pushed={"train": pushed})["clean"]


def test_a_refused_runs_storage_root_outside_the_policy_is_never_written(tmp_path, monkeypatch):
    """Review t5, finding 5: with the params refused, release fell back to their raw storage_root and wrote
    release.json wherever it pointed, outside every data root (any bucket too)."""
    outside = tmp_path / "outside"
    default_root = tmp_path / "default-root"
    monkeypatch.setenv("GPT_FINETUNE_DATA_ROOTS", str(default_root))
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_ROOT", str(default_root))
    result = release_run({"storage_root": str(outside), "bogus": 1}, "manual__refused_root", DAG_ID, make_backend)
    assert result["clean"] and not outside.exists()
    assert result["release_url"].startswith(str(default_root) + "/runs/")
    allowed = default_root / "allowed"  # a refused run whose root the policy allows keeps it
    result = release_run({"storage_root": str(allowed), "bogus": 1}, "manual__refused_root", DAG_ID, make_backend)
    assert result["release_url"].startswith(str(allowed) + "/runs/")


def test_release_counts_and_mails_the_ledgers_warnings_not_raised_live_and_a_failing_sender_never_fails_it(
        monkeypatch):
    from dataclasses import replace

    from tasks import alerts, release, telemetry
    from tasks.ledger import usage
    from tasks.ledger.summary import LiveWarning, summarize
    from tasks.release import announce_usage
    from tests.tasks.ledger.test_usage import attempt, rank
    from tests.tasks.report.test_store import document

    sent, counted = [], []
    monkeypatch.setattr(alerts, "send_alert", lambda *args, **kw: sent.append((args, kw)) or True)
    monkeypatch.setattr(telemetry, "count", lambda name, tags: counted.append((name, tags)))
    monkeypatch.setattr(telemetry, "emit_task_metrics", lambda *args, **kw: None)
    live = usage.IdleWarning(at="1970-01-01T00:10:00.000Z", ranks=(0,), slots=("h/rank0",), idle_s=950.0,
                             phase={"0": "after step 2"}, peak_util_pct=None, text="GPU time: one, raised live")
    book = usage.ledger([attempt("train", rank(0, 0, 5, 900, 100, 800))], released_at=910)
    summary = replace(summarize(book, price=None, efficiency=0.3), idle_warnings=(LiveWarning("train", 1, live),),
                      warnings=("GPU time: one, raised live", "GPU time: two"))
    report = replace(document("r1"), run_key="k1", config={"alert_conn_id": "smtp", "alert_emails": ["a@b.example"]})

    announce_usage(summary, report)
    announce_usage(summary, replace(report, config={}))  # no connection: counted, no mail
    assert counted == [("cost_warning", {"run": "k1", "task": "release"})] * 2
    assert len(sent) == 1
    (conn, recipients, subject, text), kw = sent[0]
    assert conn == "smtp" and recipients == ("a@b.example",) and "GPU time warnings" in subject
    assert "- GPU time: two" in text and "raised live" not in text and kw == {"run": "k1", "task": "release"}

    def broken(*args, **kw):
        raise OSError("statsd unreachable")

    logged = []
    monkeypatch.setattr(telemetry, "emit_task_metrics", broken)
    monkeypatch.setattr(release.log, "exception", lambda message, *args: logged.append(message % args))
    announce_usage(summary, report)
    assert logged == ["could not send the GPU-time ledger's metrics or warnings of k1"]
