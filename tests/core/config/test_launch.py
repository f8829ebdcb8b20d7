import json

import pytest

from core.config import ConfigError, RunConfig

SSH = {"backend": "ssh", "ssh_conn_ids": ["host_a", "host_b"], "storage_root": "s3://runs/root"}


@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"gpu_queue": "gpu,default"}, ["'gpu_queue' = 'gpu,default'", "not a queue name", "celery worker -q"]),
        ({"backend": "slurm"}, ["'backend' = 'slurm'", "'local'"]),
        ({"communication": "nccl"}, ["'nccl'", "use_gpu"]),
        ({"backend": "ssh"}, ["'backend' = 'ssh' needs 'ssh_conn_ids'", "one per host"]),
        ({"backend": "ssh", "ssh_conn_ids": []}, ["needs 'ssh_conn_ids'"]),
        ({"backend": "ssh", "ssh_conn_ids": "a,b"}, ["'ssh_conn_ids'", "list of strings", '["host_a", "host_b"]']),
        ({"backend": "ssh", "ssh_conn_ids": ["a b"]}, ["'ssh_conn_ids'", "'a b'", "not an Airflow connection id"]),
        ({"backend": "ssh", "ssh_conn_ids": ["a", "a"]}, ["names ['a'] more than once", "workers_per_host"]),
        ({**SSH, "workers_per_host": 3}, ["'workers_per_host' = 3 x 2 host(s)", "= 6 workers", "'num_workers' = 2"]),
        ({**SSH, "storage_root": "storage"}, ["'storage_root' = 'storage' is local", "s3://"]),
        ({**SSH, "model": "data/sample"}, ["'model' = 'data/sample' is a local path", "s3://"]),
        ({**SSH, "remote_python": "python3"}, ["'remote_python' = 'python3'", "absolute path"]),
        ({"ssh_conn_ids": ["a"]}, ["'ssh_conn_ids'", "only read by backend 'ssh'", "'backend' = 'local'"]),
        ({"workers_per_host": -1}, ["'workers_per_host' = -1", "out of range"]),
        ({"allreduce_dtype": "float16"}, ["'allreduce_dtype' = 'float16' is not allowed", "['float32', 'bfloat16']"]),
        ({"allreduce_pack_mb": -1}, ["'allreduce_pack_mb' = -1.0 is out of range", "0.0 to 1024.0"]),
        ({"allreduce_pack_mb": 1e6}, ["'allreduce_pack_mb' = 1000000.0 is out of range"]),
        ({"allreduce_pack_mb": "32MB"}, ["'allreduce_pack_mb' must be a finite number", "'32MB'"]),
    ],
)
def test_bad_backend_and_ssh_settings_name_key_value_and_what_is_allowed(params, fragments):
    with pytest.raises(ConfigError) as excinfo:
        RunConfig.from_params(params)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message


def test_ssh_settings_round_trip_through_json():
    cfg = RunConfig.from_params({**SSH, "workers_per_host": 1, "remote_python": "/opt/venv/bin/python"})
    assert cfg.launch.ssh.ssh_conn_ids == ("host_a", "host_b")
    assert cfg.settings()["ssh_conn_ids"] == cfg.to_dict()["launch"]["ssh"]["ssh_conn_ids"] == ["host_a", "host_b"]
    assert RunConfig.from_saved(json.loads(cfg.to_json())) == cfg
    cleared = RunConfig.from_params({**SSH, "remote_python": None, "remote_workdir": None})  # the form's cleared fields
    assert (cleared.launch.ssh.remote_python, cleared.launch.ssh.remote_workdir) == ("", "")


# -- elastic recovery and the scaling advisor ----------------------------------------------------------------------

@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"num_workers": 4, "min_workers": 5}, ["'min_workers' = 5", "1 to 'num_workers' = 4"]),
        ({"num_workers": 4, "min_workers": 0}, ["'min_workers' = 0", "out of range"]),
        ({"num_workers": 4, "min_workers": "2"}, ["'min_workers'", "integer or empty"]),
        ({"num_workers": 4, "min_workers": 3}, ["'min_workers' = 3", "no worker count from 3 to 3",
                                                 "4 x 1", "possible counts below 4 are [2, 1]"]),
        ({"num_workers": 5, "min_workers": 2}, ["'min_workers' = 2", "from 2 to 4", "possible counts below 5 are [1]"]),
        ({"num_workers": 4, "min_workers": 2, "num_shards": 4, "grad_accum_steps": 2},
         ["'min_workers' = 2 needs the per-slot data order", "'num_shards' = 4", "at least 8"]),
        ({"min_predicted_efficiency": 1.5}, ["'min_predicted_efficiency' = 1.5", "allowed is 0.0 to 1.0"]),
        ({"min_predicted_efficiency": -0.1}, ["'min_predicted_efficiency' = -0.1", "out of range"]),
    ],
    ids=["min-above-num", "min-zero", "min-string", "no-exact-split", "prime-workers", "too-few-shards",
         "efficiency-above-1", "efficiency-negative"],
)
def test_bad_elastic_and_advisor_settings_are_refused_naming_the_setting(params, fragments):
    with pytest.raises(ConfigError) as raised:
        RunConfig.from_params(params)
    assert all(fragment in str(raised.value) for fragment in fragments), str(raised.value)


def test_exact_worker_counts_keep_the_global_batch_and_slots():
    cfg = RunConfig.from_params({"num_workers": 4, "min_workers": 2, "grad_accum_steps": 3, "num_shards": 12})
    assert cfg.elastic_worker_counts == [4, 3, 2]  # 12 slots: 4 x 3, 3 x 4, 2 x 6
    for count in cfg.elastic_worker_counts:
        smaller = cfg.for_workers(count)
        assert smaller.global_batch_size == cfg.global_batch_size
        assert smaller.num_workers * smaller.grad_accum_steps == 12 and smaller.min_workers <= count
    assert cfg.baseline_config().min_workers is None and cfg.baseline_config().grad_accum_steps == 12
    assert RunConfig(num_workers=4).elastic_worker_counts == [4]  # unset: off
    assert RunConfig.from_params({"num_workers": 4, "min_workers": None}).lowest_worker_count == 4
    with pytest.raises(ConfigError, match="cannot split 12 slots"):
        cfg.for_workers(5)


@pytest.mark.parametrize("params, fragments", [
    ({"backend": "kubernetes", "image": ""}, ["'image'", "kubernetes", "gpt-finetune-trainer"]),
    ({"backend": "kubernetes"}, ["'storage_root' = 'storage' is local", "in pods", "s3://"]),
    ({"backend": "kubernetes", "storage_root": "s3://runs/x", "model": "data"}, ["'model'", "the pods cannot read"]),
    ({"image": "has space:1"}, ["'image'", "image reference"]),
    ({"namespace": "ML_Team"}, ["'namespace' = 'ML_Team'", "DNS label"]),
    ({"namespace": "a" * 64}, ["'namespace'", "at most 63"]),
    ({"backend": "kubernetes", "storage_root": "s3://runs/x", "gpus_per_worker": 1},
     ["'gpus_per_worker' = 1", "'use_gpu' = true"]),
    ({"use_gpu": True, "gpus_per_worker": 1}, ["'gpus_per_worker' = 1", "'kubernetes' only"]),
    ({"gpus_per_worker": -1}, ["'gpus_per_worker' = -1", "0 to 1"]),
    ({"node_selector": "gpu=h200"}, ["'node_selector'", "map of strings to strings"]),
    ({"node_selector": {"gpu": 1}}, ["'node_selector'", "map of strings to strings"]),
    ({"node_selector": {"bad key!": "x"}}, ["'node_selector' entry 'bad key!'", "label"]),
    ({"tolerations": {"key": "a"}}, ["'tolerations'", "list of objects"]),
    ({"tolerations": [{"key": "a", "effects": "NoSchedule"}]}, ["'tolerations'", "unknown keys ['effects']"]),
    ({"tolerations": [{"key": "a", "operator": "In"}]}, ["'tolerations'", "'Exists', 'Equal'"]),
    ({"tolerations": [{"key": "a", "operator": "Exists", "tolerationSeconds": -5}]},
     ["'tolerations'", "tolerationSeconds an integer of 0 or more", "GPT_FINETUNE_MAX_TOLERATION_S"]),
    ({"tolerations": [{"key": "a", "operator": "Exists", "tolerationSeconds": True}]},
     ["'tolerations'", "tolerationSeconds an integer of 0 or more"]),
    ({"tolerations": [{"key": "k" * 400, "operator": "Exists"}]}, ["'tolerations'", "at most 316 characters"]),
    ({"cpu": "four"}, ["'cpu' = 'four'", "500m"]),
    ({"memory": "16GB"}, ["'memory' = '16GB'", "16Gi"]),
    ({"service_account": "Trainer"}, ["'service_account' = 'Trainer'"]),
])
def test_bad_kubernetes_settings_are_refused_naming_the_setting(params, fragments):
    with pytest.raises(ConfigError) as excinfo:
        RunConfig.from_params(params)
    for fragment in fragments:
        assert fragment in str(excinfo.value), str(excinfo.value)


def test_kubernetes_settings_round_trip():
    cfg = RunConfig.from_params({
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"}, "cpu": "4", "memory": "16Gi",
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "namespace": "ml-team", "service_account": "trainer", "keep_failed_pods": True, "kubernetes_conn_id": None,
    })
    assert RunConfig.from_saved(json.loads(cfg.to_json())) == cfg
    assert cfg.launch.kubernetes.kubernetes_conn_id == ""


def test_auto_communication_is_nccl_with_use_gpu_and_ring_on_the_cpu():
    """TF2's own AUTO never picks NCCL: the collective resolver uses NCCL only for the hint "nccl" or the config's
    collective_nccl (tensorflow/core/common_runtime/collective_param_resolver_local.cc, AssignCollectiveType), and
    MultiWorkerMirroredStrategy sets collective_nccl only outside eager mode
    (tensorflow/python/distribute/collective_all_reduce_strategy.py:880-885 in the 2.21.0 wheel)."""
    assert RunConfig(use_gpu=True).collective_implementation == "nccl"
    assert RunConfig().collective_implementation == "ring"
    assert RunConfig(use_gpu=True, communication="ring").collective_implementation == "ring"
    assert RunConfig(use_gpu=True, communication="nccl").collective_implementation == "nccl"


@pytest.mark.parametrize("communication, resolved", [("nccl", "NCCL:"), ("auto", "'auto' is NCCL with 'use_gpu'")])
def test_bfloat16_on_the_wire_over_nccl_is_refused_before_launch(communication, resolved):
    """TF's NcclManager refuses bfloat16 on every rank at the first step: kValidDataTypes is half, float, double,
    int32, int64 (tensorflow/core/nccl/nccl_manager.cc, AddParticipant; in the 2.21.0 wheel's libtensorflow_cc.so.2
    the mask 0x8020e, without DT_BFLOAT16)."""
    with pytest.raises(ConfigError) as refused:
        RunConfig(use_gpu=True, communication=communication, allreduce_dtype="bfloat16")
    message = str(refused.value)
    for fragment in ("'allreduce_dtype' = 'bfloat16' cannot go over NCCL", resolved, "'allreduce_dtype' to 'float32'",
                     "'communication' to 'ring' to keep bfloat16 on the wire"):
        assert fragment in message, message
    # What the message offers runs.
    assert RunConfig(use_gpu=True, communication=communication).allreduce_dtype == "float32"
    assert RunConfig(use_gpu=True, communication="ring", allreduce_dtype="bfloat16").collective_implementation == "ring"
