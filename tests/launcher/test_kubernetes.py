"""The kubernetes backend through the official client against tests/support/k8s_server.py, whose pods are real
local processes (the tiny entry points): the group runner, failures, refused pods, stop, release and capacity
(each pod's status and log: test_launcher_kubernetes_pods.py)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
from kubernetes import client, config

from core.layout import StorageLayout
from core.storage import read_json
from launcher import FailureKind, GroupSpec, GroupState, WorkerGroup, WorkerSpec, kubernetes_release, tensorflow_env
from launcher.kubernetes import KubernetesBackend, KubernetesSettings
from launcher.kubernetes_api import KubernetesApiError
from launcher.kubernetes_objects import GroupNames, PodSettings
from launcher.log_policy import VERBOSE_ENV
from tasks.launch import RecordedLaunch
from tests.launcher.conftest import ACCESS_POLICY_ENV, ENTRYPOINTS, REPO
from tests.support.k8s_server import FakeKubernetes

SECRET = "s3cret-for-the-pods-only"
RUN_KEY = "manual__2026-12-01T10_00_00-0123456789"


def image_env(tmp_path: Path) -> dict[str, str]:
    """The "image's" environment: this venv's python3 first on PATH, the repo and tiny entry points importable."""
    return {"PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"]), "HOME": str(tmp_path),
            "PYTHONPATH": os.pathsep.join([str(ENTRYPOINTS), str(REPO)]), "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def cluster(tmp_path):
    with FakeKubernetes(image_env(tmp_path)) as fake:
        yield fake


def clients(cluster: FakeKubernetes) -> tuple[client.CoreV1Api, client.NetworkingV1Api]:
    configuration = client.Configuration()
    config.load_kube_config_from_dict(cluster.kubeconfig(), client_configuration=configuration)
    api = client.ApiClient(configuration)
    return client.CoreV1Api(api), client.NetworkingV1Api(api)


def backend(cluster: FakeKubernetes, **settings) -> KubernetesBackend:
    core, networking = clients(cluster)
    pod = PodSettings(image="gpt-finetune-trainer:test", grace_period_s=2)
    return KubernetesBackend(core, networking, KubernetesSettings(namespace="default", pod=pod, status_interval_s=0.2,
                                                                  **settings))


def spec(fault: str = "", num_workers: int = 2, **changes) -> GroupSpec:
    env = {"TINY_WORKER_SHOW_ENV": "AWS_SECRET_ACCESS_KEY", **({"TINY_WORKER_FAULT": fault} if fault else {})}
    settings = {"name": "tiny", "entrypoint": "tiny_worker", "num_workers": num_workers, "env": env,
                "secret_env": {"AWS_SECRET_ACCESS_KEY": SECRET}, "run_key": RUN_KEY,
                "startup_timeout_s": 20, "hang_timeout_s": 20, "grace_period_s": 2}
    return GroupSpec(**{**settings, **changes})


def run(group_spec: GroupSpec, the_backend: KubernetesBackend, tmp_path: Path):
    lines: list[tuple[int, str]] = []
    group = WorkerGroup(group_spec, the_backend, tmp_path / "work",
                        on_line=lambda rank, line: lines.append((rank, line)))
    started = time.monotonic()
    result = group.run()
    return result, time.monotonic() - started, lines


def test_a_group_runs_as_pods_that_find_each_other_by_dns_name(cluster, tmp_path, monkeypatch):
    for name, value in {**ACCESS_POLICY_ENV, VERBOSE_ENV: "1"}.items():
        monkeypatch.setenv(name, value)
    result, wall_s, lines = run(spec(num_workers=3), backend(cluster), tmp_path)
    print(f"\n3 pods: {result.state.value} in {wall_s:.2f} s")
    assert result.succeeded, result.error_message()
    assert [w.exit_code for w in result.workers] == [0, 0, 0]
    assert {(r, f"rank {r} finished") for r in range(3)} <= set(lines)
    assert (1, "AWS_SECRET_ACCESS_KEY is set") in lines, "the Secret reached the pods through envFrom"
    names = GroupNames(RUN_KEY, "tiny", "default")
    for rank in range(3):
        env = cluster.created_env(names.pod(rank))
        assert json.loads(env["TF_CONFIG"])["cluster"]["worker"] == [
            f"{names.pod(r)}.{names.service}.default.svc:2222" for r in range(3)]
        assert "CUDA_VISIBLE_DEVICES" in env and SECRET not in json.dumps(cluster.created_body(names.pod(rank)))
        assert not set(ACCESS_POLICY_ENV) & set(env), "the pods load a checked config: no access policy"
        assert env[VERBOSE_ENV] == "1"
    assert cluster.remaining() == {}, "the group's objects are deleted when it ends"


def test_a_failing_pod_fails_the_group_naming_it_and_the_rest_is_deleted(cluster, tmp_path):
    result, wall_s, _ = run(spec("1:exit1"), backend(cluster), tmp_path)
    message = result.error_message()
    print(f"\nrank 1 exits 1: detected in {wall_s:.2f} s\n{message}")
    assert result.state is GroupState.FAILED and result.failures[1].kind is FailureKind.EXIT_CODE
    assert "exited with code 1" in message and GroupNames(RUN_KEY, "tiny", "default").pod(1) in message
    assert "failing on purpose with exit code 1" in message
    assert cluster.remaining() == {}


def test_keep_failed_pods_keeps_only_the_failed_pod_and_says_so(cluster, tmp_path, caplog):
    names = GroupNames(RUN_KEY, "tiny", "default")
    result, _, _ = run(spec("1:exit1"), backend(cluster, keep_failed_pods=True), tmp_path)
    assert result.state is GroupState.FAILED
    assert cluster.remaining() == {"pods": [names.pod(1)]}
    assert f"kept failed pod(s) ['{names.pod(1)}']" in caplog.text
    kept = backend(cluster, keep_failed_pods=True).release(RUN_KEY, [])
    assert kept.clean and kept.hosts[0].evidence["kept"] == [f"pod/{names.pod(1)}"]
    assert cluster.remaining() == {"pods": [names.pod(1)]}, "release keeps it too"
    assert backend(cluster).release(RUN_KEY, []).clean and cluster.remaining() == {}, "until the setting is off"


@pytest.mark.parametrize("after, message", [
    (0, ('pods is forbidden: User "system:serviceaccount:airflow:worker" cannot create resource "pods" in API '
        'group "" in the namespace "default"')),
    (1, ('pods "x" is forbidden: exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=1, used: '
        'requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1')),
])
def test_a_refused_pod_fails_the_launch_with_the_api_reason_and_leaves_nothing(cluster, tmp_path, after, message):
    """RBAC refuses every pod; a quota admits rank 0 and refuses rank 1, whose peer is then stopped too."""
    cluster.refuse("create", "pods", 403, "Forbidden", message, after=after)
    with pytest.raises(KubernetesApiError) as excinfo:
        run(spec(env={"TINY_WORKER_STEPS": "100000"}), backend(cluster), tmp_path)
    print(f"\n{excinfo.value}")
    assert f"403 Forbidden: {message}" in str(excinfo.value)
    assert cluster.names_created("pods") == [GroupNames(RUN_KEY, "tiny", "default").pod(0)] * after
    _wait_for(lambda: cluster.remaining() == {}, 10)


def _running_group(cluster, tmp_path):
    """A two-pod group that steps until it is stopped, once both pods have made steps."""
    the_backend = backend(cluster)
    group = WorkerGroup(spec(env={"TINY_WORKER_STEPS": "100000", "TINY_WORKER_STEP_S": "0.05"}), the_backend,
                        tmp_path / "work", on_line=lambda rank, line: None)
    runner = threading.Thread(target=group.run, daemon=True)
    runner.start()
    _wait_for(lambda: b"step 2 done" in cluster.log_of(GroupNames(RUN_KEY, "tiny", "default").pod(1)), 30)
    return the_backend, group, runner


def test_stopping_the_group_deletes_every_object(cluster, tmp_path):
    _, group, runner = _running_group(cluster, tmp_path)
    assert set(cluster.remaining()) == {"pods", "services", "secrets", "networkpolicies"}
    stopped = time.monotonic()
    group.stop("test", grace_s=1)
    _wait_for(lambda: cluster.remaining() == {}, 10)
    print(f"\nstop: every object deleted after {time.monotonic() - stopped:.2f} s")
    runner.join(10)


def test_the_groups_pods_are_proven_ended_right_after_it_exits(cluster, tmp_path):
    """Issue 40, item 6 on Kubernetes: right after the group exits, the one launch path asks the backend; every pod's
    end was reported by its kubelet and none is listed running, so `release_after_train_s` is measured."""
    run = StorageLayout(str(tmp_path / "storage")).run(RUN_KEY)
    launch = RecordedLaunch(spec(), backend(cluster), run, on_line=lambda *_: None)
    result = launch.run_group()
    check = launch.after_exit.to_json()
    print(f"\npods after exit: {json.dumps(check)}")
    assert result.succeeded, result.error_message()
    names = GroupNames(RUN_KEY, "tiny", "default")
    assert check["free"] is True and check["slots"] == "cpu" and check["still_listed"] == [], check
    assert check["pods"] == {names.pod(0): "kubelet", names.pod(1): "kubelet"}
    assert 0 <= check["release_after_train_s"] < 5, check
    assert read_json(run.state_file("tiny"))["after_exit"]["release_after_train_s"] == check["release_after_train_s"]


def test_a_pod_whose_end_was_not_seen_or_that_still_runs_is_not_proven_free(cluster, tmp_path):
    """A pod deleted without a grace period (its end unseen) proves nothing; one still listed running holds the proof
    back until the bounded wait ends."""
    the_backend, group, runner = _running_group(cluster, tmp_path)
    names = GroupNames(RUN_KEY, "tiny", "default")
    evidence = {names.pod(0): "kubelet", names.pod(1): None}
    still = kubernetes_release.check_group_ended(the_backend.api, names.selector, evidence, 0.5)
    assert still["free"] is False and still["free_after_s"] is None
    assert len(still["still_listed"]) == 2 and names.pod(1) in still["note"], still
    group.stop("test", grace_s=1)
    runner.join(10)
    ended = the_backend.check_slots_free(spec(), [])
    assert ended["free"] is True and set(ended["pods"].values()) <= {"kubelet", "graceful delete"}, ended


def _abandoned_group(cluster, tmp_path, num_workers: int = 2) -> GroupNames:
    """Pods of a group whose task died without cleaning up (its launcher was SIGKILLed): they still run."""
    the_backend = backend(cluster)
    group_spec = spec(num_workers=num_workers, env={"TINY_WORKER_STEPS": "100000", "TINY_WORKER_STEP_S": "0.05"})
    placements = the_backend.place(group_spec)
    for rank, placement in enumerate(placements):
        worker = WorkerSpec(rank=rank, num_workers=num_workers, placement=placement,
                            log_file=str(tmp_path / "x.log"), workdir=str(tmp_path))
        the_backend.start(group_spec, worker, the_backend.command(group_spec),
                          {**group_spec.env, **tensorflow_env(placements, rank)})
    the_backend.close()
    names = GroupNames(RUN_KEY, "tiny", "default")
    _wait_for(lambda: all(cluster.process_of(names.pod(rank)) is not None for rank in range(num_workers)), 10)
    return names


def test_the_next_attempt_deletes_the_pods_an_earlier_one_left(cluster, tmp_path, caplog):
    """The retry runs on fewer workers (elastic): rank 2's pod is not replaced by name, the reap deletes it."""
    names = _abandoned_group(cluster, tmp_path, num_workers=3)
    with caplog.at_level("WARNING"):
        result, _, _ = run(spec(num_workers=2), backend(cluster), tmp_path)
    assert result.succeeded, result.error_message()
    ended = next(r.message for r in caplog.records if "earlier attempt" in r.message)
    print(f"\n{ended}")
    assert all(f"pod/{names.pod(rank)}" in ended for rank in range(3))
    assert cluster.remaining() == {}


def test_release_deletes_what_a_dead_task_left_by_label(cluster, tmp_path):
    """The task died without cleaning up: its pods still run. Release finds them by label and deletes it all."""
    names = _abandoned_group(cluster, tmp_path)
    report = backend(cluster).release(RUN_KEY, [])
    print(f"\nrelease: {report}")
    assert report.clean is True and cluster.remaining() == {}
    host = report.hosts[0].entry()
    assert set(host["found"]) >= {f"pod/{names.pod(0)}", f"pod/{names.pod(1)}", f"service/{names.service}",
                                  f"secret/{names.secret}", f"networkpolicy/{names.network_policy}"}
    assert host["survivors"] == []
    assert backend(cluster).release(RUN_KEY, []).clean is True, "running it twice is fine"


def test_release_waits_for_a_pod_that_takes_seconds_to_terminate_and_never_forces_it(cluster, tmp_path):
    """A pod whose kubelet ends it only 9 s after its delete (past its 2 s grace and the old 5 s allowance) is
    reported gone only once its process has ended, no pod is ever deleted with grace 0, and the record says what
    was checked and when each pod was gone."""
    names = _abandoned_group(cluster, tmp_path)
    slow = names.pod(1)
    cluster.slow_termination(slow, 9.0)
    began = time.monotonic()
    report = backend(cluster).release(RUN_KEY, [], grace_s=10)
    returned = time.monotonic()
    host = report.hosts[0].entry()
    print(f"\nrelease after {returned - began:.1f} s: pods {host.get('pods')}; checked: {host.get('checked')}")

    ended = cluster.ended_at(slow)
    assert ended is not None and began + 9.0 <= ended <= returned, "reported gone before its process ended"
    # 2: the pods' own grace; None: the Service's garbage collection, which uses it too. Never 0.
    assert {grace for _, grace, _ in cluster.deletions} <= {2, None} and cluster.deletions, "a forced deletion"
    assert report.clean is True and host["survivors"] == [] and cluster.remaining() == {}
    ends = {end["pod"]: end for end in host["pods"]}
    assert ends[slow]["grace_s"] == 2 and ends[slow]["gone_after_s"] >= 9.0
    assert ends[names.pod(0)]["gone_after_s"] < 9.0
    assert set(host["terminated"]) == {f"pod/{names.pod(0)}", f"pod/{slow}"} and host["killed"] == []
    assert f"labelled {host['selector']} in namespace default" in host["checked"]
    assert "no pod was force-deleted" in host["checked"] and host["problems"] == []


def test_a_pod_whose_kubelet_never_ends_it_is_a_survivor_and_is_not_force_deleted(cluster, tmp_path):
    """Its node is down or its container is stuck: release does not drop the object with grace 0 (which would hide
    containers that may still hold GPUs) but reports the pod, its node and what to do; the run is not released."""
    names = _abandoned_group(cluster, tmp_path)
    stuck = names.pod(0)
    cluster.slow_termination(stuck, 60.0)
    report = backend(cluster, termination_margin_s=2).release(RUN_KEY, [], grace_s=10)
    host = report.hosts[0].entry()
    print(f"\nrelease: survivors {host['survivors']}; {host.get('problems')}")

    assert report.clean is False and host["survivors"] == [f"pod/{stuck}"]
    assert cluster.names("pods") == [stuck] and cluster.ended_at(stuck) is None, "still there, still running"
    assert {grace for _, grace, _ in cluster.deletions} <= {2, None} and cluster.deletions, "a forced deletion"
    [problem] = host["problems"]
    assert f"pod default/{stuck} on node fake-node-1 is still listed (Running (terminating)) 4 s after" in problem
    assert f"kubectl delete pod {stuck} -n default --grace-period=0 --force" in problem
    assert {end["pod"]: end["gone_after_s"] for end in host["pods"]}[stuck] is None


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# -- capacity: what an elastic launch may ask for ------------------------------------------------------------------

H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}


def gpu_backend(cluster: FakeKubernetes, **pod_settings) -> KubernetesBackend:
    core, networking = clients(cluster)
    pod = PodSettings(image="gpt-finetune-trainer:test", gpus=1, node_selector=H200, **pod_settings)
    return KubernetesBackend(core, networking, KubernetesSettings(namespace="default", pod=pod))


def test_capacity_counts_the_gpus_free_on_nodes_the_pods_may_use(cluster):
    cluster.add_node("gpu-a", {"nvidia.com/gpu": "4", "cpu": "64"}, labels=H200)
    cluster.add_node("gpu-b", {"nvidia.com/gpu": "8"}, labels=H200, unschedulable=True)
    cluster.add_node("gpu-c", {"nvidia.com/gpu": "8"}, labels=H200,
                     taints=({"key": "dedicated", "value": "other-team", "effect": "NoSchedule"},))
    cluster.add_node("gpu-d", {"nvidia.com/gpu": "8"}, labels=H200, ready=False)
    cluster.add_node("cpu-e", {"cpu": "128"})
    # Another team's running pod holds 2 of gpu-a's GPUs (a limit alone is its request).
    core, _ = clients(cluster)
    cluster.node_name = "gpu-a"
    core.create_namespaced_pod("other", {"metadata": {"name": "busy"}, "spec": {"containers": [{
        "name": "c", "image": "x", "command": ["sleep", "60"], "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}})

    found = gpu_backend(cluster).capacity(spec(num_workers=4, use_gpu=True))
    assert found.workers == 2
    (reason,) = found.reasons
    assert reason.startswith("the cluster's nodes fit 2 worker pod(s) of 1 GPU (gpu-a: 2; cpu-e: none (lacks the "
                             "node_selector label(s) ['nvidia.com/gpu.product=NVIDIA-H200']); gpu-b: none (cordoned); "
                             "gpu-c: none (has the taint(s) ['dedicated:NoSchedule'] the pods do not tolerate); "
                             "gpu-d: none (not Ready))")
    tolerating = gpu_backend(cluster, tolerations=({"key": "dedicated", "operator": "Exists",
                                                    "effect": "NoSchedule"},))
    assert tolerating.capacity(spec(num_workers=4, use_gpu=True)).workers == 10


def test_capacity_is_everything_when_pods_request_nothing_or_nodes_cannot_be_listed(cluster, caplog):
    assert backend(cluster).capacity(spec(num_workers=3)).workers == 3
    assert not [path for _, path in cluster.requests if path == "/api/v1/nodes"]  # nothing to count: not asked
    cluster.refuse("list", "nodes", 403, "Forbidden", 'nodes is forbidden: User "airflow" cannot list resource')
    found = gpu_backend(cluster).capacity(spec(num_workers=3, use_gpu=True))
    assert (found.workers, found.reasons) == (3, ())
    assert "cannot tell how many pods the cluster can place" in caplog.text and "403 Forbidden" in caplog.text
