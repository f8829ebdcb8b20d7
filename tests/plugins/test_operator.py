"""TFMultiWorkerOperator: argument handling directly, and whole runs through Airflow's task runner.

The Airflow runs use `dag.test()` in a subprocess (tests/plugins/harness_dags/tfmw_harness.py): templates rendered as
native objects, the task runner's SIGTERM handler -> `on_kill`, XCom, connections from the environment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk.exceptions import AirflowFailException
from tf_multiworker import operator as operator_module
from tf_multiworker.operator import TFMultiWorkerOperator

from core.layout import StorageLayout
from core.storage import read_bytes, read_json
from tasks.release import processes_of_run
from tests.launcher.conftest import REPO, entrypoint_env, wait_until_gone
from tests.plugins.conftest import failure_excerpt

TEMPLATED = {"args", "run_config", "config_url", "output_url", "run_key", "summary_url", "env", "manifest_sha256",
             "num_workers"}
SECRET = "s3cret-value-never-logged"
HARNESS = Path(__file__).resolve().parent / "harness_dags" / "tfmw_harness.py"  # airflow_env: conftest.py


def _operator(**changes) -> TFMultiWorkerOperator:
    kwargs = {"task_id": "train", "entrypoint": "trainer.train", "args": ["--steps", "3"], "run_key": "r",
              "run_config": {"num_workers": 3, "storage_root": "/tmp/x", "startup_timeout_s": 12}}
    return TFMultiWorkerOperator(**{**kwargs, **changes})


def test_what_the_dag_renders_is_templated():
    assert set(TFMultiWorkerOperator.template_fields) == TEMPLATED


def test_the_group_follows_the_prepared_configuration():
    spec = _operator(args=["--steps", 5], env={"SEED": 7})._group_spec()
    assert (spec.num_workers, spec.use_gpu, spec.startup_timeout_s, spec.max_launch_attempts) == (3, False, 12, 3)
    assert spec.args == ("--steps", "5")
    run = StorageLayout("/tmp/x").run("r")
    files = _operator(config_url=run.config, output_url=run.train.url, args=["--manifest", "m"])
    assert files._group_spec().args == ("--config", run.config, "--output", run.train.url, "--manifest", "m")
    assert dict(spec.env) == {"SEED": "7"} and spec.run_key == "r"  # the group marks every worker with the key
    assert _operator(num_workers=1)._group_spec().num_workers == 1  # the one-worker baseline


@pytest.mark.parametrize("changes, message", [
    ({"run_config": "{'num_workers': 2}"}, "run_config must be the prepared run's configuration"),
    ({"args": "--config c"}, "args must be a list"),
    ({"args": [["nested"]]}, "args must be strings or numbers"),
    ({"env": ["A=1"]}, "env must be a mapping"),
    ({"run_key": ""}, "run_key must be the prepared run's key"),
])
def test_bad_rendered_values_fail_before_anything_starts(changes, message):
    with pytest.raises((TypeError, ValueError), match=message):
        _operator(**changes)._group_spec()


def test_live_metrics_lines_stay_out_of_the_task_log(monkeypatch):
    from tasks.telemetry import LiveLineReader
    from trainer.metrics import LIVE_PREFIX

    logged = []
    monkeypatch.setattr(TFMultiWorkerOperator, "log",
                        SimpleNamespace(info=lambda *args: logged.append(args[0] % args[1:])))
    op = _operator()
    op._live_metrics = LiveLineReader(run="r", task="train", enabled=False)
    op._log_worker_line(1, LIVE_PREFIX + '{"scope": "worker", "values": {"loss": 4.0}}')
    op._log_worker_line(1, "step 3/40 loss 4.0000")
    assert logged == ["[rank 1] step 3/40 loss 4.0000"]


@pytest.mark.parametrize("state", ["failed", "success"])
def test_an_attempt_in_a_run_that_is_over_launches_nothing(monkeypatch, state):
    """A retry Airflow started in a run marked failed meanwhile: refused before any backend exists."""
    backends = []
    monkeypatch.setattr(operator_module, "make_backend", lambda *args: backends.append(args))
    asked = []
    ti = SimpleNamespace(dag_id="gpt_finetune", run_id="manual__1",
                         get_dagrun_state=lambda dag_id, run_id: asked.append((dag_id, run_id)) or state)
    with pytest.raises(AirflowFailException, match=f"train launches no workers: DAG run manual__1 is already {state}"):
        _operator().execute({"ti": ti})
    assert asked == [("gpt_finetune", "manual__1")] and backends == []



# -- XCom is not trusted (issue 37 item 1, review finding 3) -----------------------------------------------------

def _ti(state: str = "running") -> SimpleNamespace:
    return SimpleNamespace(dag_id="gpt_finetune", run_id="manual__1", get_dagrun_state=lambda dag_id, run_id: state)


def test_the_run_key_comes_from_the_task_s_own_dag_run_not_from_xcom():
    """The review: a foreign run_key in XCom made this task's sweep of earlier attempts end another run's workers.
    The DAG passes none now; the operator derives it from (dag_id, run_id)."""
    from core.layout import run_key

    op = _operator(run_key=None, args=[], run_config={"num_workers": 3, "storage_root": "/tmp/x"})
    op._check_run(_ti())
    assert op.run_key == run_key("gpt_finetune", "manual__1") and op._group_spec().run_key == op.run_key


@pytest.mark.parametrize("setting, value", [
    ("model", "http://169.254.169.254/latest/"), ("dataset", "/etc/*.txt"), ("storage_conn_id", "metadata_db"),
])
def test_a_configuration_rewritten_in_xcom_launches_nothing(monkeypatch, tmp_path, setting, value):
    backends = []
    monkeypatch.setattr(operator_module, "make_backend", lambda *args: backends.append(args))
    op = _operator(run_key=None, run_config={"num_workers": 2, "storage_root": str(tmp_path), setting: value})
    with pytest.raises(AirflowFailException, match=f"train launches no workers: its configuration is refused: "
                                                   f"Setting '{setting}'"):
        op.execute({"ti": _ti()})
    assert backends == []


@pytest.mark.parametrize("setting, value, variable", [
    ("hang_timeout_s", 7 * 86_400, "GPT_FINETUNE_MAX_HANG_TIMEOUT_S=21600"),
    ("bpe_sample_mb", 1 << 20, "GPT_FINETUNE_MAX_BPE_SAMPLE_MB=1024"),
    ("max_run_cost", 0, "GPT_FINETUNE_MAX_RUN_COST=50"),
])
def test_a_configuration_above_the_operators_ceilings_launches_nothing(monkeypatch, tmp_path, setting, value,
                                                                       variable):
    """Review t5, finding 10: the operator's ceilings (and its cost limit) hold where the workers are launched too,
    whatever the prepared run's XCom says."""
    monkeypatch.setenv("GPT_FINETUNE_MAX_RUN_COST", "50")
    backends = []
    monkeypatch.setattr(operator_module, "make_backend", lambda *args: backends.append(args))
    run_config = {"num_workers": 2, "storage_root": str(tmp_path), "max_run_cost": 10, setting: value}
    op = _operator(run_key=None, run_config=run_config)
    with pytest.raises(AirflowFailException, match=rf"train launches no workers: its configuration is refused: "
                                                   rf"Setting '{setting}' = {value} is outside what this deployment "
                                                   rf"allows.*\({variable}\)"):
        op.execute({"ti": _ti()})
    assert backends == []

def _prepared_args(root: str, key: str) -> dict[str, str]:
    layout = StorageLayout(root)
    run = layout.run(key)
    return {"--config": run.config, "--manifest": layout.manifest("0123456789abcdef0123"), "--output": run.train.url}


@pytest.mark.parametrize("flag, url", [
    ("--config", "{root}/runs/another-run-0123456789/config.json"),  # another run's config
    ("--config", "{root}/../elsewhere/runs/{key}/config.json"),
    ("--config", "s3://attacker/config.json"),
    ("--manifest", "{root}/datasets/../runs/{key}/manifest.json"),
    ("--manifest", "{root}/datasets/not-a-fingerprint/manifest.json"),
    ("--output", "{root}/runs/another-run-0123456789/train"),
    ("--output", "{root}/baselines/a/b"),
    ("--output", "{root}/baselines/gpt2-gb16-s40-0123456789abcdef/eval.json/x"),
    ("--output", "/tmp/anywhere"),
    ("--baseline-summary", "http://127.0.0.1:9/internal/summary.json"),
    ("--baseline-summary", "{root}/baselines/not-a-key/summary.json"),
    ("--baseline-summary", "{root}/runs/{key}/train/summary.json"),
    ("--model", "{root}/runs/another-run-0123456789/train/model"),
    ("--model", "{root}/models/base/gpt2@abc/v1/model"),
    ("--model", "{root}/models/gpt_finetune/v1/../../../secret/model"),
    ("--model", "{root}/models/gpt_finetune/latest/model"),
])
def test_a_launch_url_outside_the_run_s_layout_launches_nothing(monkeypatch, tmp_path, flag, url):
    """The storage URLs the DAG renders from XCom: an edited one must not point the workers at another run's
    configuration or output, or at a place outside the policy-checked storage root."""
    from core.layout import run_key

    backends = []
    monkeypatch.setattr(operator_module, "make_backend", lambda *args: backends.append(args))
    root, key = str(tmp_path), run_key("gpt_finetune", "manual__1")
    args = {**_prepared_args(root, key), flag: url.format(root=root, key=key)}
    op = _operator(run_key=None, args=[part for pair in args.items() for part in pair],
                   run_config={"num_workers": 2, "storage_root": root})
    with pytest.raises(AirflowFailException, match=f"train launches no workers: the worker argument {flag} "
                                                   f".* is outside this run's storage layout"):
        op.execute({"ti": _ti()})
    assert backends == []


def test_the_prepared_run_s_urls_launch_with_the_digest_of_the_checked_configuration(tmp_path):
    """The URLs prepare lays out (the run's config, a dataset's manifest, the run's and a baseline's outputs, a
    baseline's summary) pass, and every worker gets the sha256 of the configuration this operator checked, as prepare
    wrote it (the run's, or its baseline's), and the manifest's pinned digest, in its environment, never in argv: no
    config digest is read from XCom."""
    import hashlib

    from core.config import RunConfig
    from core.config.pinned import save_config
    from core.layout import run_key
    from core.protocol import CONFIG_SHA256_ENV, MANIFEST_SHA256_ENV

    root, key = str(tmp_path), run_key("gpt_finetune", "manual__1")
    run, baseline = StorageLayout(root).run(key), StorageLayout(root).baseline("gpt2-gb16-s40-0123456789abcdef")
    cfg = RunConfig.from_saved({"num_workers": 2, "storage_root": root})
    written = {run.config: save_config(run.config, cfg),
               run.baseline_config: save_config(run.baseline_config, cfg.baseline_config())}
    args = _prepared_args(root, key)
    for config, output in ((run.config, run.train.url), (run.config, run.report), (run.baseline_config, baseline.url)):
        op = _operator(run_key=None, config_url=config, output_url=output,
                       args=["--manifest", args["--manifest"], "--baseline-summary", baseline.summary],
                       manifest_sha256="cd" * 32, env={CONFIG_SHA256_ENV: "caller's", MANIFEST_SHA256_ENV: "caller's"},
                       run_config=cfg.to_dict())
        op._check_run(_ti())
        spec = op._group_spec()
        assert spec.env[CONFIG_SHA256_ENV] == written[config] == hashlib.sha256(Path(config).read_bytes()).hexdigest()
        assert written[config] not in spec.args
        assert spec.env[MANIFEST_SHA256_ENV] == "cd" * 32 and "cd" * 32 not in spec.args


def test_a_summary_url_that_is_not_the_output_s_own_launches_nothing(tmp_path):
    """The operator checks that summary.json exists after the workers exit: an edited XCom must not make it probe
    another run's, a bucket's or an internal service's URL."""
    from core.layout import run_key

    root, key = str(tmp_path), run_key("gpt_finetune", "manual__1")
    run = StorageLayout(root).run(key)
    other = StorageLayout(root).run("other-0123456789").train.summary
    for summary in ("http://127.0.0.1:9/internal/summary.json", other):
        op = _operator(run_key=None, args=[], output_url=run.train.url, summary_url=summary,
                       run_config={"num_workers": 2, "storage_root": root})
        with pytest.raises(AirflowFailException, match=re.escape(
                f"train launches no workers: its summary_url {summary!r} is not the summary.json of its --output "
                f"(it must be {run.train.summary!r})")):
            op._check_run(_ti())
    _operator(run_key=None, args=[], output_url=run.train.url, summary_url=run.train.summary,
              run_config={"num_workers": 2, "storage_root": root})._check_run(_ti())


@pytest.mark.parametrize("pin", [None, ""])
def test_a_manifest_without_a_pinned_digest_launches_nothing(tmp_path, pin):
    """Review t5, finding 11: the dataset is pinned like the config, so a launch with --manifest needs its digest."""
    from core.layout import run_key

    root, key = str(tmp_path), run_key("gpt_finetune", "manual__1")
    op = _operator(run_key=None, args=[part for pair in _prepared_args(root, key).items() for part in pair],
                   manifest_sha256=pin, run_config={"num_workers": 2, "storage_root": root})
    with pytest.raises(AirflowFailException, match=f"train launches no workers: its --manifest has no pinned digest "
                                                   rf"\(manifest_sha256 is {pin!r}\): pass the prepared run's XCom "
                                                   "'manifest_sha256'"):
        op._check_run(_ti())


# -- through Airflow's task runner ------------------------------------------------------------------------------

def _case(tmp_path, *, entrypoint="tiny_worker", args=(), worker_env=None, run_key=None, operator_args=None,
          **settings) -> Path:
    """A harness run. Its run key is its own: an attempt ends what carries its run key and group on every host
    first, and xdist may run another file's harness runs (test_operator_kubernetes.py) at the same time."""
    case = {
        "entrypoint": entrypoint,
        "args": list(args),
        "env": entrypoint_env(**(worker_env or {})),
        "operator_args": operator_args or {},
        "params": {"run_key": run_key or f"run-{uuid.uuid4().hex[:8]}",
                   "run_config": {"num_workers": 2, "backend": "local", "use_gpu": False,
                                  "storage_root": str(tmp_path / "storage"), "storage_conn_id": "",
                                  "startup_timeout_s": 60, "hang_timeout_s": 60, **settings}},
    }
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    return path


def prepared_launch(case: Path, manifest: str, output: str = "train") -> None:
    """The case's run laid out as prepare lays one out under its storage root and run key: its configuration written
    where and as prepare writes it (the operator pins the digest of that configuration, its `run_config`), and the
    worker arguments the DAG renders put before the case's: the run's config, `manifest` (under the storage root's
    datasets/) and the output `output` of the run's directory."""
    import core.config.launch as launch_rules
    from core.config import RunConfig
    from core.config.pinned import save_config
    from trainer.data import read_manifest

    content = json.loads(case.read_text())
    settings = content["params"]["run_config"]
    run = StorageLayout(settings["storage_root"]).run(content["params"]["run_key"])
    check_shared_storage = launch_rules._check_shared_storage
    if content.get("shared_disk"):  # as the harness lifts it for the fake cluster's pods (tfmw_harness.py)
        launch_rules._check_shared_storage = lambda *args: None
    try:
        save_config(run.config, RunConfig.from_saved(settings))
    finally:
        launch_rules._check_shared_storage = check_shared_storage
    content["args"] = ["--config", run.config, "--manifest", manifest, "--output", f"{run.url}/{output}",
                       *content["args"]]
    content["operator_args"] = {**content.get("operator_args", {}), "manifest_sha256": read_manifest(manifest)[1]}
    case.write_text(json.dumps(content))


def _run_key(case: Path) -> str:
    return json.loads(case.read_text())["params"]["run_key"]


def _start(airflow_env, case: Path, tmp_path, extra_env=None) -> tuple[subprocess.Popen, Path, Path]:
    out, log = tmp_path / "out.json", tmp_path / "task.log"
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, str(HARNESS), str(out)],
            env={**airflow_env, "TFMW_HARNESS_CASE": str(case), **(extra_env or {})}, cwd=REPO, stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, out, log


def _finish(process: subprocess.Popen, timeout: float) -> None:
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def s3_run_storage(s3_server: str, tmp_path: Path, password: str = "test-secret") -> tuple[dict, dict]:
    """(run settings, environment) of a storage root on the test S3 server, through the connection `run_storage` (of
    the test deployment's allow-list, tests/conftest.py): workers on other hosts or in pods need one (RunConfig)."""
    connection = {"conn_type": "aws", "login": "test-key", "password": password,
                  "extra": {"endpoint_url": s3_server, "region_name": "us-east-1"}}
    return ({"storage_root": f"s3://runs/{tmp_path.name}", "storage_conn_id": "run_storage"},
            {"AIRFLOW_CONN_RUN_STORAGE": json.dumps(connection)})


def test_success_on_s3_with_credentials_from_a_connection(airflow_env, tmp_path, s3_server):
    connection = {"conn_type": "aws", "login": "test-key", "password": SECRET,
                  "extra": {"endpoint_url": s3_server, "region_name": "us-east-1"}}
    # A connection id of the test deployment's allow-list (tests/conftest.py): the operator holds the config to it.
    case = _case(tmp_path, storage_root="s3://runs/root", storage_conn_id="run_storage",
                 worker_env={"TINY_WORKER_SHOW_ENV": "AWS_SECRET_ACCESS_KEY"})
    process, out, log = _start(airflow_env, case, tmp_path, {"AIRFLOW_CONN_RUN_STORAGE": json.dumps(connection)})
    _finish(process, timeout=120)
    task_log = log.read_text(errors="replace")
    result = json.loads(out.read_text())
    assert result["task_states"] == {"group": "success", "collect": "success"}, failure_excerpt(task_log)

    assert "[rank 1] AWS_SECRET_ACCESS_KEY is set" in task_log and "[rank 0] rank 0 finished" in task_log
    assert SECRET not in task_log and SECRET not in out.read_text()

    summary, record = result["summary"], result["state_record"]
    assert [w["exit_code"] for w in summary["workers"]] == [0, 0] and summary["launch_attempts"] == 1
    assert summary["state_url"] == f"s3://runs/root/runs/{_run_key(case)}/state/group.json"
    assert record["state"] == "succeeded" and [w["rank"] for w in record["workers"]] == [0, 1]
    assert all(set(w) == {"rank", "host", "pid", "pgid", "port", "gpus", "gpu_idle_mb"} for w in record["workers"])

    s3 = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": s3_server}
    os.environ.update(s3)
    try:
        assert read_json(summary["state_url"]) == record
        assert b"rank 1 step 4 done" in read_bytes(summary["logs_url"] + "/rank-1.log")
    finally:
        for name in s3:
            os.environ.pop(name)


def test_failing_rank_fails_the_task_and_its_logs_are_still_uploaded(airflow_env, tmp_path):
    case = _case(tmp_path, worker_env={"TINY_WORKER_FAULT": "1:exit1"})
    process, out, log = _start(airflow_env, case, tmp_path)
    _finish(process, timeout=120)
    task_log = log.read_text(errors="replace")
    result = json.loads(out.read_text())
    assert result["task_states"]["group"] == "failed", task_log[-3000:]
    assert "WorkerFailedError" in task_log and "rank 1 (host 127.0.0.1, pid" in task_log
    assert "exited with code 1" in task_log and "| failing on purpose with exit code 1" in task_log
    assert result["state_record"]["state"] == "failed"
    logs = tmp_path / "storage" / "runs" / _run_key(case) / "logs" / "group"
    assert "failing on purpose" in (logs / "rank-1.log").read_text()
    assert wait_until_gone([w["pgid"] for w in result["state_record"]["workers"]], 0) == []


def test_sigterm_to_the_task_stops_a_two_worker_tf_training_run(airflow_env, tmp_path):
    case = _case(tmp_path, entrypoint="tiny_mwms", args=["--steps", "100000", "--step-sleep", "0.05"],
                 startup_timeout_s=120)
    process, out, log = _start(airflow_env, case, tmp_path)
    state_file = tmp_path / "storage" / "runs" / _run_key(case) / "state" / "group.json"
    try:
        deadline = time.monotonic() + 120
        while "[rank 1] rank 1 step 3 " not in log.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        pgids = [w["pgid"] for w in json.loads(state_file.read_text())["workers"]]
        assert len(pgids) == 2 and all(wait_until_gone([pgid], 0) for pgid in pgids), "workers should be training"
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        left = wait_until_gone(pgids, timeout_s=10)
        stopped_after = time.monotonic() - sent
    finally:
        _finish(process, timeout=60)
    print(f"\nSIGTERM to the task: workers gone after {stopped_after:.2f} s")
    task_log = log.read_text(errors="replace")
    assert left == [], f"worker groups {left} still alive 10 s after SIGTERM"
    result = json.loads(out.read_text())
    assert result["task_states"]["group"] == "failed", task_log[-3000:]
    assert "WorkerGroupStoppedError" in task_log and "was stopped from outside" in task_log
    assert json.loads(state_file.read_text())["state"] == "stopped"


def _sigkill_mid_training(process: subprocess.Popen, log: Path, key: str, started_line: str, workers: int) -> float:
    """SIGKILL the task's process (`airflow dags test` runs the task in it) once its workers print `started_line`
    and then nothing (a quiet phase: no log write can fail and end the task's process by accident); returns the
    seconds until no process of run `key` is left, at most 10."""
    try:
        deadline = time.monotonic() + 120
        while started_line not in log.read_text(errors="replace") or len(processes_of_run(key)) < workers:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGKILL)  # the task's whole process group, as a container's OOM kill would
        killed = time.monotonic()
        while processes_of_run(key) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        gone_s, left = time.monotonic() - killed, processes_of_run(key)
    finally:
        _finish(process, timeout=30)
    assert left == {}, f"still alive 10 s after SIGKILL of the task: {left}"
    return gone_s


def test_sigkill_of_the_task_mid_training_leaves_no_worker_of_a_quiet_tf_run(airflow_env, tmp_path):
    case = _case(tmp_path, entrypoint="tiny_mwms", args=["--steps", "3", "--step-sleep", "600"],
                 startup_timeout_s=120, run_key="kill9-local")
    process, _, log = _start(airflow_env, case, tmp_path)
    gone_s = _sigkill_mid_training(process, log, "kill9-local", "[rank 1] rank 1 step 0 ", workers=2)
    print(f"\nSIGKILL of the task (dags test) while its TF workers print nothing: workers gone after {gone_s:.2f} s")


# -- over SSH (real sshd hosts on 127.0.0.2 and 127.0.0.3, tests/support/sshd.py) --------------------------------------

def _ssh_env(ssh_hosts, s3_server, tmp_path) -> dict[str, str]:
    return {**{name: value for host in ssh_hosts for name, value in host.connection_env().items()},
            **s3_run_storage(s3_server, tmp_path)[1]}


def _ssh_case(tmp_path, ssh_hosts, s3_server, **kwargs) -> Path:
    return _case(tmp_path, backend="ssh", ssh_conn_ids=[h.conn_id for h in ssh_hosts],
                 **s3_run_storage(s3_server, tmp_path)[0], **kwargs)


def test_a_worker_sigkilled_on_one_ssh_host_fails_the_task_naming_host_and_rank(airflow_env, tmp_path, ssh_hosts,
                                                                                s3_server):
    case = _ssh_case(tmp_path, ssh_hosts, s3_server, worker_env={"TINY_WORKER_FAULT": "1:sigkill"},
                     run_key="ssh-kill1")
    process, out, log = _start(airflow_env, case, tmp_path, _ssh_env(ssh_hosts, s3_server, tmp_path))
    _finish(process, timeout=120)
    task_log = log.read_text(errors="replace")
    result = json.loads(out.read_text())
    assert result["task_states"]["group"] == "failed", task_log[-3000:]
    assert f"rank 1 (host {ssh_hosts[1].address}, pid " in task_log and "killed by SIGKILL" in task_log
    assert f"[rank 0 host {ssh_hosts[0].address}]" in task_log  # live lines say where they come from
    record = result["state_record"]
    assert [w["conn_id"] for w in record["workers"]] == [h.conn_id for h in ssh_hosts]
    assert processes_of_run("ssh-kill1") == {}, "a process of the run outlived the task on some host"


def test_sigterm_to_the_task_ends_every_remote_process_within_10_seconds(airflow_env, tmp_path, ssh_hosts, s3_server):
    case = _ssh_case(tmp_path, ssh_hosts, s3_server,
                     worker_env={"TINY_WORKER_STEPS": "100000", "TINY_WORKER_STEP_S": "0.1"}, run_key="ssh-term1")
    process, out, log = _start(airflow_env, case, tmp_path, _ssh_env(ssh_hosts, s3_server, tmp_path))
    try:
        deadline = time.monotonic() + 120
        while "[rank 1 host " not in log.read_text(errors="replace") or len(processes_of_run("ssh-term1")) < 4:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while processes_of_run("ssh-term1") and time.monotonic() - sent < 10:
            time.sleep(0.1)
        stopped_after = time.monotonic() - sent
        left = processes_of_run("ssh-term1")
    finally:
        _finish(process, timeout=60)
    print(f"\nSIGTERM to an SSH task: remote processes gone after {stopped_after:.2f} s")
    assert left == {}, f"still alive 10 s after SIGTERM: {left}"
    assert json.loads(out.read_text())["task_states"]["group"] == "failed"


def test_sigkill_of_the_task_mid_training_leaves_no_remote_worker(airflow_env, tmp_path, ssh_hosts, s3_server):
    case = _ssh_case(tmp_path, ssh_hosts, s3_server, worker_env={"TINY_WORKER_STEPS": "3", "TINY_WORKER_STEP_S": "600"},
                     run_key="kill9-ssh")
    process, _, log = _start(airflow_env, case, tmp_path, _ssh_env(ssh_hosts, s3_server, tmp_path))
    gone_s = _sigkill_mid_training(process, log, "kill9-ssh", "[rank 1 host ", workers=4)
    print(f"\nSIGKILL of an SSH task while its workers print nothing: remote processes gone after {gone_s:.2f} s")
