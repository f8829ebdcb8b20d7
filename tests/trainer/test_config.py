import dataclasses
import json

import pytest

from trainer.config import MODEL_PRESETS, ConfigError, RunConfig, field_names


def test_defaults_are_valid_and_round_trip():
    cfg = RunConfig()
    assert RunConfig.from_params(cfg.to_dict()) == cfg
    assert RunConfig.from_params(json.loads(cfg.to_json())) == cfg
    assert cfg.global_batch_size == cfg.batch_size_per_worker * cfg.num_workers * cfg.grad_accum_steps


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().num_workers = 3  # type: ignore[misc]


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
    assert RunConfig.from_params({"max_steps": 7}).steps_for(train_sequences=100) == 7
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
