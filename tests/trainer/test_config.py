import dataclasses
import json

import pytest

from trainer.config import MODEL_PRESETS, ConfigError, RunConfig, field_names
from trainer.layout import REPO_ROOT


def test_defaults_are_valid_and_round_trip():
    cfg = RunConfig()
    assert RunConfig.from_params(cfg.to_dict()) == cfg
    assert RunConfig.from_params(json.loads(cfg.to_json())) == cfg
    assert cfg.global_batch_size == cfg.batch_size_per_worker * cfg.num_workers * cfg.grad_accum_steps


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().num_workers = 3  # type: ignore[misc]


SSH = {"backend": "ssh", "ssh_conn_ids": ["host_a", "host_b"], "storage_root": "s3://runs/root"}


@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"num_wokers": 2}, ["Unknown run setting", "num_wokers", "num_workers"]),
        ({"num_workers": "4"}, ["'num_workers'", "'4'", "integer", "without quotes"]),
        ({"num_workers": 4.0}, ["'num_workers'", "integer"]),
        ({"num_workers": True}, ["'num_workers'", "integer"]),
        ({"num_workers": 0}, ["'num_workers' = 0", "out of range", "1 to 64"]),
        ({"num_workers": 65}, ["'num_workers' = 65", "1 to 64"]),
        ({"xla": "yes"}, ["'xla'", "true or false"]),
        ({"gpu_queue": "gpu,default"}, ["'gpu_queue' = 'gpu,default'", "not a queue name", "celery worker -q"]),
        ({"prepare_tasks": 300}, ["'prepare_tasks' = 300", "0 to 256"]),
        ({"learning_rate": 0}, ["'learning_rate'", "(0, 1]"]),
        ({"learning_rate": float("nan")}, ["'learning_rate'", "finite"]),
        ({"batch_size_per_worker": 0}, ["'batch_size_per_worker' = 0", "out of range"]),
        ({"mixed_precision": "fp8"}, ["'mixed_precision' = 'fp8'", "'bf16'"]),
        ({"backend": "slurm"}, ["'backend' = 'slurm'", "'local'"]),
        ({"baseline": "maybe"}, ["'baseline'", "'auto'"]),
        ({"storage_root": "gs://bucket"}, ["'storage_root'", "scheme 'gs'"]),
        ({"tokenizer": "bpe:abc"}, ["'tokenizer'", "bpe:<vocab size>"]),
        ({"tokenizer": "bpe:100"}, ["'tokenizer'", "260 to 1000000"]),
        ({"model": "tiny", "block_size": 512}, ["'block_size' = 512", "'tiny'", "256 positions"]),
        ({"max_steps": 5, "warmup_steps": 5}, ["'warmup_steps' = 5", "'max_steps' = 5"]),
        ({"num_workers": 4, "num_shards": 2}, ["'num_shards' = 2", "'num_workers' = 4"]),
        ({"communication": "nccl"}, ["'nccl'", "use_gpu"]),
        ({"mixed_precision": "fp16"}, ["'fp16'", "use_gpu"]),
        ({"dataset": "  "}, ["'dataset'", "empty"]),
        ({"model_name": "../etc"}, ["'model_name' = '../etc'", "not a safe name", "letters, digits"]),
        ({"model_name": "a/b"}, ["'model_name' = 'a/b'", "not a safe name"]),
        ({"model_name": ""}, ["'model_name'", "not a safe name"]),
        ({"model": "promoted:.hidden"}, ["'model' = 'promoted:.hidden'", "'.hidden'", "not a safe name"]),
        ({"promotion_tolerance": -0.1}, ["'promotion_tolerance' = -0.1", "out of range", "0.0 to 100.0"]),
        ({"promote": "sometimes"}, ["'promote' = 'sometimes'", "'auto'", "'always'", "'never'"]),
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
        (
            {"batch_size_per_worker": 4096, "num_workers": 64, "grad_accum_steps": 8},
            ["Global batch", "4096 x 64 x 8", "lower one of them"],
        ),
    ],
)
def test_bad_settings_name_key_value_and_what_is_allowed(params, fragments):
    with pytest.raises(ConfigError) as excinfo:
        RunConfig.from_params(params)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message


def test_promoted_model_names_the_registered_model_it_continues_from():
    assert RunConfig(model="promoted").promoted_source == "gpt_finetune"
    assert RunConfig(model="promoted", model_name="chat").promoted_source == "chat"
    assert RunConfig(model="promoted:nightly-chat").promoted_source == "nightly-chat"
    assert RunConfig(model="tiny").promoted_source is None


def test_ssh_settings_round_trip_through_json():
    cfg = RunConfig.from_params({**SSH, "workers_per_host": 1, "remote_python": "/opt/venv/bin/python"})
    assert cfg.ssh_conn_ids == ("host_a", "host_b") and cfg.to_dict()["ssh_conn_ids"] == ["host_a", "host_b"]
    assert RunConfig.from_params(json.loads(cfg.to_json())) == cfg
    cleared = RunConfig.from_params({**SSH, "remote_python": None, "remote_workdir": None})  # the form's cleared fields
    assert (cleared.remote_python, cleared.remote_workdir) == ("", "")


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match="'num_workers'"):
        RunConfig(num_workers="2")  # type: ignore[arg-type]


def test_integers_are_accepted_for_float_settings():
    cfg = RunConfig.from_params({"epochs": 2, "learning_rate": 1})
    assert cfg.epochs == 2.0 and isinstance(cfg.epochs, float)


def test_baseline_config_keeps_global_batch():
    cfg = RunConfig.from_params({"num_workers": 4, "grad_accum_steps": 2, "batch_size_per_worker": 3})
    baseline = cfg.baseline_config()
    assert baseline.num_workers == 1
    assert baseline.grad_accum_steps == 8
    assert baseline.global_batch_size == cfg.global_batch_size == 24


def test_steps_from_epochs_when_max_steps_is_zero():
    cfg = RunConfig.from_params({"max_steps": 0, "warmup_steps": 0, "epochs": 2.0})
    assert cfg.steps_for(train_sequences=100) == 13  # ceil(2 * 100 / 16)
    assert RunConfig.from_params({"max_steps": 7, "warmup_steps": 2}).steps_for(train_sequences=100) == 7
    with pytest.raises(ConfigError, match="no sequences"):
        cfg.steps_for(train_sequences=0)


def test_shards_default_to_four_per_worker():
    assert RunConfig.from_params({"num_workers": 3}).effective_num_shards == 12
    assert RunConfig.from_params({"num_workers": 3, "num_shards": 5}).effective_num_shards == 5


def test_summary_lists_every_setting_once():
    lines = RunConfig().summary_lines()
    for name in field_names():
        assert sum(line.startswith(name + " ") for line in lines) == 1
    assert any("global_batch_size" in line for line in lines)


def test_presets_fit_their_block_sizes():
    for name, preset in MODEL_PRESETS.items():
        RunConfig.from_params({"model": name, "block_size": preset["n_positions"]})


def test_cleared_connection_field_means_environment_credentials():
    assert RunConfig.from_params({"storage_conn_id": None}).storage_conn_id == ""
    with pytest.raises(ConfigError, match="'dataset' must be a string"):
        RunConfig.from_params({"dataset": None})


DEMO_SETTINGS = [  # scripts/demo.py, the compose stack and settings like the docs' (tests/test_readme.py checks those)
    {},
    {"num_workers": 3},
    {"storage_root": "s3://gpt-finetune", "storage_conn_id": "minio_s3"},
    {"dataset": "data/sample/tempest_gut.txt", "model": "gpt2", "tokenizer": "gpt2"},
    {"dataset": "file://" + str(REPO_ROOT / "data" / "sample"), "model": "openai-community/gpt2"},
    {"dataset": "s3://gpt-finetune/corpus/*.jsonl", "model": "s3://gpt-finetune/runs/x/train/model",
     "tokenizer": "s3://gpt-finetune/runs/x/train/model"},
]


@pytest.fixture
def operator_policy(monkeypatch, tmp_path):
    """The defaults an operator gets: the repository's data/ and the storage root; a bucket allow-list."""
    monkeypatch.delenv("GPT_FINETUNE_DATA_ROOTS", raising=False)
    monkeypatch.setenv("GPT_FINETUNE_STORAGE_ROOT", str(tmp_path / "storage"))
    monkeypatch.setenv("GPT_FINETUNE_S3_BUCKETS", "gpt-finetune, shared-corpora")
    return tmp_path


@pytest.mark.parametrize("params", DEMO_SETTINGS)
def test_defaults_and_demo_settings_are_allowed(operator_policy, params):
    RunConfig.from_params({"storage_root": str(operator_policy / "storage"), **params})


@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"model": "http://127.0.0.1:9/x"}, ["'model'", "http://127.0.0.1:9/x", "scheme 'http', which is not allowed", "s3://"]),
        ({"tokenizer": "https://example.com/tok"}, ["'tokenizer'", "which is not allowed"]),
        ({"dataset": "ftp://host/corpus.txt"}, ["'dataset'", "which is not allowed"]),
        ({"dataset": "hf://datasets/x"}, ["'dataset'", "which is not allowed"]),
        ({"dataset": "/etc/passwd"}, ["'dataset' = '/etc/passwd'", "outside the allowed data roots",
                                      str(REPO_ROOT / "data"), "GPT_FINETUNE_DATA_ROOTS"]),
        ({"dataset": "file:///etc/passwd"}, ["'dataset'", "outside the allowed data roots"]),
        ({"dataset": "../../x"}, ["'dataset' = '../../x'", "'..'"]),
        ({"dataset": "data/../../etc/*.txt"}, ["'dataset'", "'..'"]),
        ({"model": "s3://gpt-finetune/../other/model"}, ["'model'", "'..'"]),
        ({"dataset": "~/.ssh/*"}, ["'dataset'", "outside the allowed data roots"]),
        ({"dataset": "s3://airflow-logs/*.txt"}, ["'dataset'", "bucket 'airflow-logs' is not allowed",
                                                  "['gpt-finetune', 'shared-corpora']", "GPT_FINETUNE_S3_BUCKETS"]),
        ({"storage_root": "s3://airflow-logs/x"}, ["'storage_root'", "bucket 'airflow-logs'"]),
        ({"storage_root": "/etc"}, ["'storage_root' = '/etc'", "outside the allowed data roots"]),
        ({"model": str(REPO_ROOT / "dags")}, ["'model'", "outside the allowed data roots"]),
        ({"storage_root": "s3:///nobucket"}, ["'storage_root'", "names no bucket"]),
    ],
)
def test_settings_that_reach_beyond_the_allowed_places_are_refused(operator_policy, params, fragments):
    with pytest.raises(ConfigError) as error:
        RunConfig.from_params({"storage_root": str(operator_policy / "storage"), **params})
    for fragment in fragments:
        assert fragment in str(error.value)


def test_a_symlink_out_of_a_data_root_is_refused(operator_policy):
    storage = operator_policy / "storage"
    storage.mkdir()
    (storage / "escape").symlink_to("/etc")
    with pytest.raises(ConfigError, match="outside the allowed data roots"):
        RunConfig(storage_root=str(storage), dataset=str(storage / "escape" / "*.conf"))


def test_configured_roots_replace_the_defaults_and_empty_bucket_list_allows_any(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT_FINETUNE_DATA_ROOTS", f"{tmp_path}/corpora:{tmp_path}/runs")
    monkeypatch.setenv("GPT_FINETUNE_S3_BUCKETS", "")
    cfg = RunConfig(dataset=f"{tmp_path}/corpora/*.txt", storage_root=f"{tmp_path}/runs", model="s3://any/model")
    assert cfg.dataset.endswith("corpora/*.txt")
    with pytest.raises(ConfigError, match="outside the allowed data roots"):
        RunConfig(storage_root=f"{tmp_path}/runs")  # the default dataset, data/sample, is no longer allowed


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
    ({"use_gpu": True, "gpus_per_worker": 2}, ["'gpus_per_worker' = 2", "'kubernetes' only"]),
    ({"gpus_per_worker": 17}, ["'gpus_per_worker' = 17", "0 to 16"]),
    ({"node_selector": "gpu=h200"}, ["'node_selector'", "map of strings to strings"]),
    ({"node_selector": {"gpu": 1}}, ["'node_selector'", "map of strings to strings"]),
    ({"node_selector": {"bad key!": "x"}}, ["'node_selector' entry 'bad key!'", "label"]),
    ({"tolerations": {"key": "a"}}, ["'tolerations'", "list of objects"]),
    ({"tolerations": [{"key": "a", "effects": "NoSchedule"}]}, ["'tolerations'", "unknown keys ['effects']"]),
    ({"tolerations": [{"key": "a", "operator": "In"}]}, ["'tolerations'", "'Exists', 'Equal'"]),
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
    assert RunConfig.from_params(json.loads(cfg.to_json())) == cfg
    assert cfg.kubernetes_conn_id == ""


@pytest.mark.parametrize("params, fragments", [
    ({"alert_emails": ["ops@example.com"]}, ["'alert_emails' needs 'alert_conn_id'", "smtp"]),
    ({"alert_conn_id": "alerts"}, ["'alert_conn_id' = 'alerts' needs 'alert_emails'"]),
    ({"alert_conn_id": "alerts", "alert_emails": ["ops"]}, ["'alert_emails' has ['ops']", "name@domain"]),
    ({"alert_conn_id": "alerts", "alert_emails": "ops@example.com"}, ["'alert_emails' must be a list of strings"]),
    ({"max_loss_rise": -1}, ["'max_loss_rise' = -1.0 is out of range", "0.0 to 100.0"]),
    ({"min_throughput_ratio": 1.5}, ["'min_throughput_ratio' = 1.5 is out of range", "0.0 to 1.0"]),
], ids=["emails-without-connection", "connection-without-emails", "not-an-address", "emails-not-a-list",
        "negative-rise", "ratio-above-1"])
def test_bad_monitoring_settings_are_refused_naming_the_setting(params, fragments):
    with pytest.raises(ConfigError) as raised:
        RunConfig.from_params(params)
    assert all(fragment in str(raised.value) for fragment in fragments), str(raised.value)


def test_alert_settings_round_trip_and_cleared_fields_mean_no_alerts():
    cfg = RunConfig.from_params({"alert_conn_id": "alerts", "alert_emails": ["ops@example.com", "a.b@ml.example.org"]})
    assert cfg.alert_emails == ("ops@example.com", "a.b@ml.example.org")
    assert RunConfig.from_params(cfg.to_dict()) == cfg
    cleared = RunConfig.from_params({"alert_conn_id": None, "alert_emails": None})  # the trigger form's empty fields
    assert (cleared.alert_conn_id, cleared.alert_emails) == ("", ())
