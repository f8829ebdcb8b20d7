"""A setting is declared once, on its field: from there it reaches the Params, the config and docs/settings.md."""

from dataclasses import dataclass

import pytest
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamValidationError

from core.config import SETTINGS, ConfigError, RunConfig, schema
from core.config.schema import param_kwargs, setting
from core.config.table import table


@dataclass(frozen=True)
class WithProbeRate(RunConfig):
    """RunConfig and one setting more, declared as a setting is: on its field, nowhere else."""

    probe_rate: float = setting(0.5, "Probe rate", "Share of steps that probe.", minimum=0, maximum=1)


def test_a_setting_declared_on_its_field_reaches_the_params_the_config_and_the_docs_table():
    declared = schema.by_name(WithProbeRate)["probe_rate"]
    assert (declared.section, declared.type, declared.default) == ("", "number", 0.5)

    param = Param(**param_kwargs(declared))  # as the DAG builds each of its Params
    assert param.resolve(0.25) == 0.25
    with pytest.raises(ParamValidationError):
        param.resolve(2)

    assert WithProbeRate.of(probe_rate=0.25).probe_rate == 0.25
    assert WithProbeRate().settings()["probe_rate"] == 0.5
    with pytest.raises(ConfigError, match=r"Setting 'probe_rate' = 2\.0 is out of range: allowed is 0\.0 to 1\.0\."):
        WithProbeRate.of(probe_rate=2)
    with pytest.raises(ConfigError, match=r"Setting 'probe_rate' must be a finite number, got 'x' \(str\)\."):
        WithProbeRate.of(probe_rate="x")

    row = "| `probe_rate` | core | number | `0.5` | [0, 1] | Share of steps that probe. |"
    assert row in table(schema.declared(WithProbeRate)).splitlines()
    assert "probe_rate" not in {s.name for s in SETTINGS}  # RunConfig itself is untouched


def test_every_setting_is_a_declared_field_in_the_form_order_sections_after_the_core():
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names)) and names[:2] == ["num_workers", "min_workers"]
    sections = [s.section for s in SETTINGS]
    assert sections == sorted(sections, key=["", "launch", "launch.ssh", "launch.kubernetes", "promotion",
                                             "monitoring"].index)
    assert {s.name: s.type for s in SETTINGS if s.name in ("xla", "ssh_conn_ids", "node_selector", "epochs")} == {
        "epochs": "number", "xla": "boolean", "ssh_conn_ids": "array", "node_selector": "object"}


def test_types_are_checked_strictly_and_containers_frozen():
    with pytest.raises(ConfigError, match=r"Setting 'num_workers' must be an integer, got '4' \(str\)\. In --conf"):
        RunConfig.of(num_workers="4")
    with pytest.raises(ConfigError, match=r"Setting 'use_gpu' must be true or false, got 1 \(int\)\."):
        RunConfig.of(use_gpu=1)
    with pytest.raises(ConfigError, match=r"Setting 'learning_rate' must be a finite number, got inf"):
        RunConfig.of(learning_rate=float("inf"))
    with pytest.raises(ConfigError, match=r"Setting 'epochs' must be a finite number, got True \(bool\)\."):
        RunConfig.of(epochs=True)
    cfg = RunConfig.of(epochs=2, alert_emails=["a@b.io"], alert_conn_id="smtp", node_selector={"pool": "gpu"})
    assert cfg.epochs == 2.0 and isinstance(cfg.epochs, float)
    assert cfg.monitoring.alert_emails == ("a@b.io",)
    with pytest.raises(TypeError):
        cfg.launch.kubernetes.node_selector["pool"] = "cpu"  # type: ignore[index]
