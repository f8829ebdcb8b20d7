"""Base models fetched once, pinned and cached (tasks/base_models.py), against a local hub in huggingface_hub's cache
layout (tests/support/local_hub.py) with HF_HUB_OFFLINE=1: no network anywhere."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from core.config import ConfigError, RunConfig
from core.layout import StorageLayout
from core.storage import read_json
from tasks.base_models import pinned_base, resolve_base_model
from tests.support import local_hub
from tests.tasks import run_fixtures


def config(tmp_path: Path, **settings) -> RunConfig:
    return RunConfig.from_params({"storage_root": str(tmp_path / "storage"), "model": "gpt2", **settings})


@pytest.fixture
def hub(tmp_path) -> Path:
    return tmp_path / "hub"


def test_a_hub_model_is_fetched_once_then_reused_without_the_hub(tmp_path, hub, caplog):
    sha = local_hub.add_model(hub, "gpt2")
    caplog.set_level(logging.INFO, logger="gpt_finetune.base_models")
    cfg, record = resolve_base_model(config(tmp_path, tokenizer="gpt2"), cache_dir=hub)
    url = StorageLayout(str(tmp_path / "storage")).base_model("gpt2", sha)
    assert url.endswith(f"/models/base/gpt2@{sha}")
    assert (cfg.model, cfg.tokenizer, cfg.model_revision) == (url, url, sha)
    assert (record.name, record.revision, record.sha, record.format_version) == ("gpt2", "main", sha, 1)
    stored = read_json(f"{url}/base_model.json")  # the record's keys as before: earlier copies keep loading
    assert stored == record.to_xcom() and set(stored) == {"format_version", "name", "revision", "sha", "fetched_at",
                                                          "files"}
    assert {"name": "model.safetensors", "bytes": Path(url, "model.safetensors").stat().st_size} in stored["files"]
    files = sorted(path.name for path in Path(url).iterdir())
    assert files == ["base_model.json", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert f"Base model gpt2@{sha} (revision 'main'): fetched once to {url}" in caplog.text
    # What promotion records in version.json and the model card names: the base at its commit.
    assert pinned_base(cfg).to_xcom() == {"name": "gpt2", "revision": "main", "sha": sha, "url": url}
    assert pinned_base(config(tmp_path, model="tiny")) is None

    shutil.rmtree(hub)  # the second run cannot reach the hub at all: its pinned commit is served from storage
    caplog.clear()
    again, _ = resolve_base_model(config(tmp_path, model_revision=sha), cache_dir=hub)
    assert again.model == url and f"Base model gpt2@{sha} (revision '{sha}'): reusing {url}" in caplog.text

    local_hub.add_model(hub, "gpt2")  # the hub still names the same head, but holds no weights any more:
    (hub / "models--gpt2" / "snapshots" / sha / "model.safetensors").unlink()  # nothing is fetched again
    latest, _ = resolve_base_model(config(tmp_path), cache_dir=hub)
    assert latest.model == url and "fetched once" not in caplog.text


def test_a_cached_copy_whose_record_is_of_another_shape_is_refused_naming_the_file_and_the_field(tmp_path, hub):
    from core.document import DocumentError
    from core.storage import write_json_atomic

    sha = local_hub.add_model(hub, "gpt2")
    cfg, record = resolve_base_model(config(tmp_path), cache_dir=hub)
    write_json_atomic(f"{cfg.model}/base_model.json", {**record.to_xcom(), "sha": 40})
    for read in (lambda: pinned_base(cfg), lambda: resolve_base_model(config(tmp_path, model_revision=sha),
                                                                      cache_dir=hub)):
        with pytest.raises(DocumentError, match=r"base_model.json: BaseModelRecord.sha: expected str"):
            read()


def test_a_pinned_revision_resolves_to_its_commit_and_an_unknown_one_is_refused_by_name(tmp_path, hub):
    old = local_hub.add_model(hub, "openai-community/gpt2", revisions=("v1",), seed=1)
    head = local_hub.add_model(hub, "openai-community/gpt2", revisions=("main",), seed=2)
    pinned, _ = resolve_base_model(config(tmp_path, model="openai-community/gpt2", model_revision="v1"), cache_dir=hub)
    latest, _ = resolve_base_model(config(tmp_path, model="openai-community/gpt2"), cache_dir=hub)
    assert pinned.model.endswith(f"/models/base/openai-community--gpt2@{old}") and pinned.model_revision == old
    assert latest.model.endswith(f"@{head}") and latest.model_revision == head
    by_sha, _ = resolve_base_model(config(tmp_path, model="openai-community/gpt2", model_revision=old), cache_dir=hub)
    assert by_sha.model == pinned.model
    with pytest.raises(ConfigError, match=r"Setting 'model_revision' = 'v9': revision 'v9' of model "
                                          r"'openai-community/gpt2' cannot be resolved"):
        resolve_base_model(config(tmp_path, model="openai-community/gpt2", model_revision="v9"), cache_dir=hub)
    with pytest.raises(ConfigError, match="'model_revision' = 'main' applies to a hub model name"):
        config(tmp_path, model="tiny", model_revision="main")


def test_files_that_are_no_checkpoint_the_trainer_reads_are_refused_before_training(tmp_path, hub):
    local_hub.add_model(hub, "acme/mistral", architecture="MistralForCausalLM")
    with pytest.raises(ConfigError, match=r"Setting 'model' = 'acme/mistral' \(revision 'main', commit [0-9a-f]{40}\): "
                                          r".*config.json: architectures \['MistralForCausalLM'\] is not supported: "
                                          r"the supported architectures are GPT2LMHeadModel"):
        resolve_base_model(config(tmp_path, model="acme/mistral"), cache_dir=hub)
    local_hub.add_model(hub, "acme/tf-only", safetensors=False)
    with pytest.raises(ConfigError, match=r"Setting 'model' = 'acme/tf-only' .*model.safetensors"):
        resolve_base_model(config(tmp_path, model="acme/tf-only"), cache_dir=hub)
    local_hub.add_model(hub, "acme/gpt2")
    with pytest.raises(ConfigError, match=r"Setting 'model' = 'acme/gpt2' .*block_size 128 exceeds the 64 positions"):
        resolve_base_model(config(tmp_path, model="acme/gpt2", block_size=128), cache_dir=hub)
    assert not (tmp_path / "storage" / "models" / "base").exists() or not any(
        (tmp_path / "storage" / "models" / "base").iterdir())


def test_a_copy_cached_for_the_tf_model_is_fetched_again_as_safetensors(tmp_path, hub):
    """Copies made before base models were safetensors checkpoints hold tf_model.h5: their record lists no
    .safetensors file, so the next prepare replaces them."""
    from core.storage import write_json_atomic
    from tasks.base_models import BaseModelRecord, SnapshotFile

    sha = local_hub.add_model(hub, "gpt2")
    url = Path(StorageLayout(str(tmp_path / "storage")).base_model("gpt2", sha))
    url.mkdir(parents=True)
    (url / "tf_model.h5").write_bytes(b"old weights")
    write_json_atomic(str(url / "base_model.json"), BaseModelRecord(
        format_version=1, name="gpt2", revision="main", sha=sha, fetched_at="2026-11-01T00:00:00+00:00",
        files=(SnapshotFile("tf_model.h5", 11),)).to_xcom())
    cfg, record = resolve_base_model(config(tmp_path), cache_dir=hub)
    assert cfg.model == str(url) and "model.safetensors" in {file.name for file in record.files}
    assert not (url / "tf_model.h5").exists()


def test_a_half_written_cache_is_never_used(tmp_path, hub):
    sha = local_hub.add_model(hub, "gpt2")
    url = Path(StorageLayout(str(tmp_path / "storage")).base_model("gpt2", sha))
    url.mkdir(parents=True)  # a killed prepare's copy: files, but no base_model.json
    (url / "model.safetensors").write_bytes(b"truncated")
    (url.parent / f".{url.name}.partial-999999-dead").mkdir()  # and the stage it left (its process is gone)
    cfg, _ = resolve_base_model(config(tmp_path), cache_dir=hub)
    assert cfg.model == str(url) and json.loads((url / "base_model.json").read_text())["sha"] == sha
    fetched = hub / "models--gpt2" / "snapshots" / sha / "model.safetensors"
    assert (url / "model.safetensors").stat().st_size == fetched.stat().st_size
    assert [path.name for path in url.parent.iterdir()] == [url.name]


def test_workers_load_the_cached_copy_offline_and_the_sha_is_in_the_baseline_key(tmp_path, hub):
    from tasks.baseline import baseline_key_parts
    from trainer.decoders.pretrained import load_pretrained

    first = local_hub.add_model(hub, "gpt2", revisions=("v1",), seed=1)
    second = local_hub.add_model(hub, "gpt2", seed=2)
    cfg, _ = resolve_base_model(config(tmp_path, model_revision="v1"), cache_dir=hub)
    shutil.rmtree(hub)
    model = load_pretrained(cfg.model, vocab_size=local_hub.VOCAB, block_size=32, work_dir=tmp_path)
    assert model.config.n_embd == local_hub.TINY["n_embd"]
    other = cfg.replace(model=cfg.model.replace(first, second), model_revision=second)
    manifest = read_json(run_fixtures.write_manifest(cfg.storage_root))
    parts = baseline_key_parts(cfg, manifest, 10), baseline_key_parts(other, manifest, 10)
    assert parts[0].settings["model_revision"] == first and parts[1].settings["model_revision"] == second
    assert parts[0].settings["model"] != parts[1].settings["model"]


def test_a_relative_model_directory_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    resolved, record = resolve_base_model(config(tmp_path, model="models/mine", tokenizer="models/mine"))
    assert record is None
    assert resolved.model == resolved.tokenizer == str(tmp_path / "models" / "mine")


def test_a_model_directory_relative_to_the_repository_is_made_absolute_from_there(tmp_path, monkeypatch):
    (tmp_path / "repo" / "models" / "mine").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setattr("core.layout.REPO_ROOT", tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "elsewhere")
    resolved, record = resolve_base_model(config(tmp_path, model="models/mine", tokenizer="models/mine"))
    assert record is None
    assert resolved.model == resolved.tokenizer == str(tmp_path / "repo" / "models" / "mine")
