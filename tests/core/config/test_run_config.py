import dataclasses
import json
import re

import pytest

from core.config import ConfigError, LaunchConfig, RunConfig, field_names


def test_defaults_are_valid_and_round_trip():
    cfg = RunConfig()
    assert RunConfig.from_saved(cfg.to_dict()) == cfg
    assert RunConfig.from_saved(json.loads(cfg.to_json())) == cfg
    assert cfg.global_batch_size == cfg.batch_size_per_worker * cfg.num_workers * cfg.grad_accum_steps


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().num_workers = 3  # type: ignore[misc]
    pods = RunConfig.of(node_selector={"pool": "gpu"}, tolerations=[{"key": "gpu", "operator": "Exists"}])
    with pytest.raises(TypeError):
        pods.launch.kubernetes.node_selector["pool"] = "cpu"  # type: ignore[index]
    with pytest.raises(TypeError):
        pods.launch.kubernetes.tolerations[0]["key"] = "other"  # type: ignore[index]
    assert pods.to_dict()["launch"]["kubernetes"]["node_selector"] == {"pool": "gpu"}  # JSON again when saved


def test_saved_configs_are_nested_by_concern_and_settings_keep_their_flat_names():
    cfg = RunConfig.of(backend="ssh", ssh_conn_ids=["host_a"], storage_root="s3://runs/x", model_name="chat",
                       alert_conn_id="smtp", alert_emails=["ops@example.com"])
    saved = cfg.to_dict()
    assert set(saved) - set(RunConfig.__dataclass_fields__) == set()
    assert saved["launch"]["backend"] == "ssh" and saved["launch"]["ssh"]["ssh_conn_ids"] == ["host_a"]
    assert saved["promotion"]["model_name"] == "chat" and saved["monitoring"]["alert_conn_id"] == "smtp"
    assert "alert_conn_id" not in saved and "namespace" not in saved  # the worker's config carries no flat SMTP/pods
    assert list(cfg.settings()) == field_names()  # the Params' shape, for logs and the trigger form
    assert RunConfig.from_saved(saved) == RunConfig.from_saved(cfg.settings()) == cfg


def test_a_flat_config_saved_by_an_earlier_version_still_loads():
    """config.json, baseline_config.json and report.json's config of runs before the sections were flat (the Params'
    shape): an earlier run's report (the advisor's and the throughput watch's comparison) and a reused baseline
    still read."""
    flat = {**RunConfig().settings(), "num_workers": 4, "backend": "local", "promote": "never", "max_run_cost": 5.0}
    cfg = RunConfig.from_saved(flat)
    assert (cfg.num_workers, cfg.promotion.promote, cfg.monitoring.max_run_cost) == (4, "never", 5.0)
    with pytest.raises(ConfigError, match=r"Unknown run setting\(s\) \['launch_backend'\]"):
        RunConfig.from_saved({"launch_backend": "ssh"})


def test_replace_takes_settings_by_their_flat_names():
    cfg = RunConfig().replace(num_workers=4, namespace="ml-team", export_formats=())
    assert (cfg.num_workers, cfg.launch.kubernetes.namespace, cfg.promotion.export_formats) == (4, "ml-team", ())
    with pytest.raises(ConfigError, match="'namespace' = 'Team_A'"):
        cfg.replace(namespace="Team_A")


@pytest.mark.parametrize(
    "params, fragments",
    [
        ({"num_wokers": 2}, ["Unknown run setting", "num_wokers", "num_workers"]),
        ({"num_workers": "4"}, ["'num_workers'", "'4'", "integer", "without quotes"]),
        ({"num_workers": 4.0}, ["'num_workers'", "integer"]),
        ({"num_workers": True}, ["'num_workers'", "integer"]),
        ({"xla": "yes"}, ["'xla'", "true or false"]),
        ({"learning_rate": float("nan")}, ["'learning_rate'", "finite"]),
    ],
)
def test_unknown_keys_and_wrong_types_name_the_setting(params, fragments):
    with pytest.raises(ConfigError) as excinfo:
        RunConfig.from_params(params)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, message


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigError, match="'num_workers'"):
        RunConfig(num_workers="2")  # type: ignore[arg-type]


def test_integers_are_accepted_for_float_settings():
    cfg = RunConfig.from_params({"epochs": 2, "learning_rate": 1})
    assert cfg.epochs == 2.0 and isinstance(cfg.epochs, float)


def test_promoted_model_names_the_registered_model_it_continues_from():
    assert RunConfig(model="promoted").promoted_source == "gpt_finetune"
    assert RunConfig.of(model="promoted", model_name="chat").promoted_source == "chat"
    assert RunConfig(model="promoted:nightly-chat").promoted_source == "nightly-chat"
    assert RunConfig(model="tiny").promoted_source is None


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


def test_cleared_connection_field_means_environment_credentials():
    assert RunConfig.from_params({"storage_conn_id": None}).storage_conn_id == ""
    with pytest.raises(ConfigError, match="'dataset' must be a string"):
        RunConfig.from_params({"dataset": None})


@pytest.mark.parametrize("build, message", [
    (lambda: RunConfig(launch={}), "RunConfig.launch must be a LaunchConfig, got {}"),
    (lambda: LaunchConfig(ssh={}), "LaunchConfig.ssh must be a SSHConfig, got {}"),
])
def test_a_section_given_as_a_mapping_is_refused_naming_its_type(build, message):
    with pytest.raises(TypeError, match=re.escape(message)):
        build()
