"""TFMultiWorkerOperator with backend=kubernetes through Airflow's real task runner (tests/plugins/harness_dags), the
cncf.kubernetes provider's hook and the official client, against tests/support/k8s_server.py: its pods are real local
processes, so the preflight and the training job below are the real trainer on two pods."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from tf_multiworker.backends import make_backend

from core.layout import run_key
from core.storage import read_json
from launcher import GroupSpec, WorkerSpec, tensorflow_env
from launcher.kubernetes_objects import GroupNames
from tasks.release import release_run
from tests.launcher.test_kubernetes import backend, image_env
from tests.plugins.conftest import REPO, failure_excerpt
from tests.plugins.test_operator import _case, _finish, _run_key, _start, prepared_launch
from tests.support.k8s_server import FakeKubernetes
from tests.trainer.shards import write_dataset

CONN_ID = "k8s_fake"
# Same data, same initialisation, same summation order: the local and the pod runs agree to float32 rounding.
EVAL_LOSS_TOLERANCE = 1e-4
TRAIN_CONFIG = {"model": "tiny", "tokenizer": "bpe:320", "block_size": 32, "batch_size_per_worker": 4,
                "max_steps": 12, "warmup_steps": 2, "learning_rate": 3e-3, "checkpoint_every_steps": 12,
                "collective_timeout_s": 60, "num_workers": 2}


@pytest.fixture
def cluster(tmp_path):
    home = tmp_path / "pod-home"
    home.mkdir()
    with FakeKubernetes({**image_env(home), "TMPDIR": str(home), "TF_CPP_MIN_LOG_LEVEL": "2"}) as fake:
        yield fake


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> str:
    """A dataset under a storage root shared by the module's runs (`storage_of`), as prepare lays it out."""
    return write_dataset(tmp_path_factory.mktemp("storage") / "datasets", sorted((REPO / "data" / "sample").glob(
        "*.txt")), block_size=32, vocab_size=320, num_train_shards=4, max_chars=20_000)


def storage_of(manifest: str) -> Path:
    return Path(manifest).parents[2]


def connection(cluster: FakeKubernetes) -> dict[str, str]:
    return {f"AIRFLOW_CONN_{CONN_ID.upper()}": json.dumps({"conn_type": "kubernetes",
                                                          "extra": {"kube_config": cluster.kubeconfig()}})}


def pod_case(tmp_path: Path, backend_name: str = "kubernetes", **kwargs) -> Path:
    """A harness case whose pods share this machine's disk, as the fake cluster's do (a real cluster's pods do not:
    RunConfig refuses a local storage root for them, and the harness, like the pods' workers, lifts that one rule for
    this case: the workers load the run's configuration as the operator checked it, backend and all)."""
    worker_env = {"TFMW_TEST_SHARED_DISK": "1", **kwargs.pop("worker_env", {})}  # tests/launcher/entrypoints
    case = _case(tmp_path, backend=backend_name, kubernetes_conn_id=CONN_ID, namespace="default",
                 image="gpt-finetune-trainer:test", worker_env=worker_env, **kwargs)
    case.write_text(json.dumps({**json.loads(case.read_text()), "shared_disk": True}))
    return case


def run_case(airflow_env, cluster, case: Path, tmp_path: Path, timeout: float) -> tuple[dict, str]:
    process, out, log = _start(airflow_env, case, tmp_path, connection(cluster))
    _finish(process, timeout=timeout)
    return json.loads(out.read_text()), log.read_text(errors="replace")


def test_preflight_runs_as_pods(airflow_env, tmp_path, cluster, manifest):
    key = f"preflight-{uuid.uuid4().hex[:8]}"
    case = pod_case(tmp_path, entrypoint="trainer.preflight", startup_timeout_s=180, hang_timeout_s=180, run_key=key,
                    storage_root=str(storage_of(manifest)), **TRAIN_CONFIG)
    prepared_launch(case, manifest, output="report")
    report = Path(json.loads(case.read_text())["args"][5])
    result, task_log = run_case(airflow_env, cluster, case, tmp_path, timeout=300)
    assert result["task_states"]["group"] == "success", failure_excerpt(task_log)
    preflight = json.loads((report / "preflight.json").read_text())
    print(f"\npreflight on 2 pods: {json.dumps(preflight)[:300]}")
    assert [w["rank"] for w in result["state_record"]["workers"]] == [0, 1]
    assert {w["pod"] for w in result["state_record"]["workers"]} == set(cluster.names_created("pods"))
    assert cluster.remaining() == {}


def test_training_on_pods_gives_the_eval_loss_of_the_local_backend(airflow_env, tmp_path, cluster, manifest):
    models = {}
    for name in ("local", "kubernetes"):
        work = tmp_path / name
        work.mkdir()
        key = f"{name}-{uuid.uuid4().hex[:8]}"
        case = pod_case(work, name, entrypoint="trainer.train", startup_timeout_s=180, hang_timeout_s=180, run_key=key,
                        storage_root=str(storage_of(manifest)), **TRAIN_CONFIG)
        prepared_launch(case, manifest)
        output = Path(json.loads(case.read_text())["args"][5])
        started = time.monotonic()
        result, task_log = run_case(airflow_env, cluster, case, work, timeout=420)
        print(f"\n{name}: train task {result['task_states']['group']} in {time.monotonic() - started:.1f} s")
        assert result["task_states"]["group"] == "success", failure_excerpt(task_log)
        models[name] = output / "model"
    assert f"[rank 1 pod {GroupNames(_run_key(case), 'group', 'default').pod(1)}] TFMW_READY rank=1" in task_log
    losses = _eval_losses(manifest, models)
    print(f"eval loss local {losses['local']:.8f} kubernetes {losses['kubernetes']:.8f} "
          f"|delta| {abs(losses['local'] - losses['kubernetes']):.2e}")
    assert abs(losses["local"] - losses["kubernetes"]) < EVAL_LOSS_TOLERANCE
    assert cluster.remaining() == {}


def _eval_losses(manifest: str, models: dict[str, Path]) -> dict[str, float]:
    code = ("import json, sys; from trainer.evaluate import evaluate; "
            "print(json.dumps({k: evaluate(v, sys.argv[1]).eval_loss for k, v in json.loads(sys.argv[2]).items()}))")
    out = subprocess.run([sys.executable, "-c", code, manifest, json.dumps({k: str(v) for k, v in models.items()})],
                         capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_killing_the_task_deletes_every_object_of_the_group(airflow_env, tmp_path, cluster):
    """A real MultiWorkerMirroredStrategy job, whose workers catch SIGTERM and keep running (preemption notices):
    only the pod deletion with grace 0 after ON_KILL_GRACE_S ends them, within Airflow's 5 s."""
    case = pod_case(tmp_path, entrypoint="tiny_mwms", args=["--steps", "100000", "--step-sleep", "0.05"],
                    startup_timeout_s=120)
    process, out, log = _start(airflow_env, case, tmp_path, connection(cluster))
    try:
        deadline = time.monotonic() + 180
        while "] rank 1 step 3 " not in log.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        assert set(cluster.remaining()) == {"pods", "services", "networkpolicies"}
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while cluster.remaining() and time.monotonic() - sent < 10:
            time.sleep(0.05)
        emptied_after = time.monotonic() - sent
        left = cluster.remaining()
    finally:
        _finish(process, timeout=60)
    print(f"\nSIGTERM to the task: every object deleted after {emptied_after:.2f} s")
    assert left == {}, f"still there 10 s after SIGTERM: {left}"
    task_log = log.read_text(errors="replace")
    assert json.loads(out.read_text())["task_states"]["group"] == "failed"
    assert "WorkerGroupStoppedError" in task_log


def test_a_pending_pod_fails_the_task_at_the_startup_timeout_with_its_events(airflow_env, tmp_path, cluster):
    cluster.hold_pending("*-1", message="0/2 nodes are available: 2 node(s) didn't match Pod's node affinity.")
    result, task_log = run_case(airflow_env, cluster, pod_case(tmp_path, startup_timeout_s=6), tmp_path, timeout=120)
    assert result["task_states"]["group"] == "failed"
    assert "WorkerStartupTimeoutError" in task_log and "startup_timeout_s=6" in task_log
    assert "FailedScheduling: 0/2 nodes are available: 2 node(s) didn't match Pod's node affinity." in task_log
    assert cluster.remaining() == {}


def test_release_deletes_the_leftovers_of_a_dead_task_by_label(tmp_path, cluster, monkeypatch, s3_server):
    monkeypatch.setenv(*next(iter(connection(cluster).items())))
    for name, value in {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret",
                        "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    key = run_key("gpt_finetune", "manual__dead_task")
    leftovers = backend(cluster)
    spec = GroupSpec(name="train", entrypoint="tiny_worker", num_workers=2, run_key=key, grace_period_s=2,
                     env={"TINY_WORKER_STEPS": "100000"}, secret_env={"AWS_SECRET_ACCESS_KEY": "x" * 8})
    placements = leftovers.place(spec)
    for rank, placement in enumerate(placements):
        leftovers.start(spec, WorkerSpec(rank, 2, placement, str(tmp_path / "log"), str(tmp_path)),
                        leftovers.command(spec), {**spec.env, **tensorflow_env(placements, rank)})
    leftovers.close()  # the task died here: nothing was cleaned up
    names = GroupNames(key, "train", "default")
    assert set(cluster.remaining()) == {"pods", "services", "secrets", "networkpolicies"}
    root = f"s3://runs/{tmp_path.name}"  # pods share no disk with Airflow: the run's storage is on S3
    params = {"backend": "kubernetes", "kubernetes_conn_id": CONN_ID, "storage_root": root}
    result = release_run(params, "manual__dead_task", "gpt_finetune", make_backend, grace_period_s=2)
    record = read_json(result["release_url"])  # runs/<key>/report/release.json (core/layout.py)
    pods = next(h for h in record["hosts"] if h["backend"] == "kubernetes")
    print(f"\nrelease on the cluster: {pods}")
    assert result["clean"] is True and record["clean"] is True
    assert f"pod/{names.pod(1)}" in pods["found"] and pods["survivors"] == []
    assert cluster.remaining() == {}
