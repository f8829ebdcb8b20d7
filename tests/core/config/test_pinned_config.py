"""A run configuration pinned by the digest of its bytes (core/config/pinned.py; issue 37, item 1): the real worker
entry points, launched as the operator launches them, refuse a config.json rewritten on storage after the Airflow
side checked and wrote it, and exit EXIT_PERMANENT; the unmodified file passes."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from core.config import RunConfig
from core.config.pinned import ConfigChangedError, load_pinned_config, save_config
from core.layout import StorageLayout
from core.protocol import CONFIG_SHA256_ENV, EXIT_PERMANENT
from core.storage import read_bytes, read_json, write_json_atomic
from launcher import GroupSpec, LocalBackend, WorkerGroup
from tests.trainer.preflight import workers
from trainer.job import plan_job

REWRITE = {"model": "http://169.254.169.254/latest/"}  # what the access policy refuses, and from_saved alone does not


def _prepared(tmp_path: Path) -> tuple[dict[str, str], str]:
    """A dataset and the run's config.json written as prepare writes it; the preflight's arguments and the digest."""
    paths = workers.dataset(tmp_path, num_workers=1)
    paths["config"] = StorageLayout(str(tmp_path)).run("r").config
    digest = save_config(paths["config"], RunConfig(num_workers=1, storage_root=str(tmp_path)))
    return paths, digest


def _rewrite(url: str) -> str:
    write_json_atomic(url, {**read_json(url), **REWRITE})
    return hashlib.sha256(read_bytes(url)).hexdigest()


def _launch(entrypoint: str, paths: dict[str, str], digest: str, workdir: Path):
    lines: list[str] = []
    spec = GroupSpec(name=entrypoint, entrypoint=entrypoint, args=workers.args(paths), num_workers=1,
                     env={**workers.WORKER_ENV, CONFIG_SHA256_ENV: digest}, startup_timeout_s=120, hang_timeout_s=120)
    result = WorkerGroup(spec, LocalBackend(), workdir, on_line=lambda rank, line: lines.append(line)).run()
    return result, "\n".join(lines)


@pytest.mark.parametrize("entrypoint", ["trainer.train", "trainer.preflight"])
def test_a_config_rewritten_on_storage_after_prepare_is_refused_by_the_worker(tmp_path, entrypoint):
    paths, digest = _prepared(tmp_path)
    rewritten = _rewrite(paths["config"])
    result, log = _launch(entrypoint, paths, digest, tmp_path / "work")
    assert not result.succeeded and result.failures[0].exit_code == EXIT_PERMANENT, log[-3000:]
    assert (f"the run configuration {paths['config']} has sha256 {rewritten}, but the Airflow side pinned {digest} "
            f"({CONFIG_SHA256_ENV})") in log
    assert "the file was changed after the Airflow side checked it" in log and "trigger a new run" in log
    assert "169.254.169.254" not in log  # refused before it is parsed, let alone used


def test_the_unmodified_config_passes_the_preflight_and_plans_the_training_job(tmp_path):
    paths, digest = _prepared(tmp_path)
    result, log = _launch("trainer.preflight", paths, digest, tmp_path / "work")
    assert result.succeeded, log[-3000:]
    assert "is not pinned" not in log
    job = plan_job(paths["config"], paths["manifest"], paths["output"], environ={CONFIG_SHA256_ENV: digest})
    assert job.cfg == RunConfig(num_workers=1, storage_root=str(tmp_path))


def test_the_advisor_probe_refuses_a_rewritten_config(tmp_path, monkeypatch, caplog):
    from trainer import advisor_probe

    paths, digest = _prepared(tmp_path)
    _rewrite(paths["config"])
    monkeypatch.setenv(CONFIG_SHA256_ENV, digest)
    assert advisor_probe.main(["--config", paths["config"], "--manifest", paths["manifest"],
                               "--out", str(tmp_path / "probe.json")]) == 1
    assert "ConfigChangedError" in caplog.text and "changed after the Airflow side checked it" in caplog.text


def test_without_a_pinned_digest_the_file_loads_as_it_is_and_a_warning_says_so(tmp_path, caplog):
    """A worker started by hand or by a bench script: only an absent variable goes unpinned; an empty one is
    refused (the operator never sets one empty)."""
    paths, _ = _prepared(tmp_path)
    with caplog.at_level(logging.WARNING, logger="core.config"):
        assert load_pinned_config(paths["config"], {}).num_workers == 1
    assert f"{paths['config']} is not pinned (no {CONFIG_SHA256_ENV} in the environment" in caplog.text
    with pytest.raises(ConfigChangedError, match=r"but the Airflow side pinned \(empty\)"):
        load_pinned_config(paths["config"], {CONFIG_SHA256_ENV: ""})
