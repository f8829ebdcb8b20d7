"""`make_backend`: every backend name the launcher lists has a factory, and an unknown name names the setting."""

from __future__ import annotations

import pytest
from tf_multiworker.backends import FACTORIES, UnknownBackendError, make_backend

from core.protocol import BACKEND_NAMES


def test_unknown_backend_is_refused_with_the_setting_to_change():
    from core.config import RunConfig

    with pytest.raises(UnknownBackendError, match=r"backend 'slurm' is not available: choose one of local.*"
                                                  r"\(setting 'backend'\)"):
        make_backend(RunConfig(), "slurm")


def test_one_backend_table_feeds_the_config_and_the_dag():
    from core.config import ConfigError, RunConfig
    from dags.gpt_finetune import PARAMS

    assert PARAMS["backend"].schema["enum"] == list(BACKEND_NAMES)
    assert make_backend(RunConfig()).name == "local"
    assert set(FACTORIES) == set(BACKEND_NAMES)
    with pytest.raises(ConfigError, match="backend"):
        RunConfig.of(backend="slurm")
