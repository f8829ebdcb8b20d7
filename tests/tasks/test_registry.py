"""tasks.registry on local disk and on the S3 server alike: a damaged pointer is named with its field, earlier
promotions' files still read, claims are exclusive,
copies list their files, and a version counts only when every file it records is there. The exclusive create and
the compare-and-swap themselves are tested in tests/core/storage/test_conditional.py.

The promote task's use of it (the rule, races and kills) is tested in test_promote.py."""

from __future__ import annotations

import json
import re

import pytest

from core.storage import join, read_json, write_bytes_atomic, write_json_atomic
from tasks import registry


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "storage")
    return request.getfixturevalue("s3_bucket") + "/gpt"


@pytest.fixture
def layout(root):
    return registry.model_layout(root, "gpt_finetune")


@pytest.fixture
def local_layout(tmp_path):
    """For what goes through storage's generic calls alone, where the S3 server only adds seconds."""
    return registry.model_layout(str(tmp_path / "storage"), "gpt_finetune")


def write_files(url: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        write_bytes_atomic(join(url, name), data)


def test_a_model_never_promoted_has_no_pointer(layout):
    assert registry.read_latest(layout) is None


ENTRY = {"version": "v1", "number": 1, "url": "models/gpt_finetune/v1", "model_url": "models/gpt_finetune/v1/model",
         "run_id": "nightly__1", "run_key": "gpt_finetune__nightly__1", "promoted_at": "2026-12-01T02:00:00+00:00",
         "eval_loss": 5.3, "perplexity": 200.34, "dataset_fingerprint": "3f2a9c01d4e5b6a7c8d9",
         "run_report_url": "runs/gpt_finetune__nightly__1/report/report.json"}
SAMPLED = {**ENTRY, "eval_loss_se": 0.01, "eval_sample": "s-1234"}


def stored_pointer(entry: dict, history: list[dict]) -> dict:
    return {"format_version": 1, "name": "gpt_finetune", **entry, "history": history}


def placed(entry: dict, layout) -> dict:
    """`entry` naming its version's folder and model under `layout`, as promote writes it."""
    version = layout.version(entry["number"])
    return {**entry, "url": version.url, "model_url": version.model}


@pytest.mark.parametrize(("stored", "problem"), [
    (b'{"version": "v1", "hist', "is not valid JSON"),
    (b'{"version": "v1"}', "Pointer: missing key(s) number, url"),
    (b'["v1"]', "Pointer: expected a JSON object, got list"),
    (json.dumps(stored_pointer(ENTRY, [{**ENTRY, "eval_loss": "5.3"}])).encode(),
     "Pointer.history[0]: Entry.eval_loss: expected float, got str '5.3'"),
    (json.dumps(stored_pointer({**ENTRY, "number": "1"}, [ENTRY])).encode(), "Pointer.number: expected int"),
    (json.dumps(stored_pointer(ENTRY, ENTRY)).encode(), "Pointer.history: expected"),
])
def test_a_damaged_pointer_is_an_error_that_names_it_and_the_field(layout, stored, problem):
    write_bytes_atomic(layout.latest, stored)
    with pytest.raises(registry.RegistryError, match=re.escape(problem)) as raised:
        registry.read_latest(layout)
    assert layout.latest in str(raised.value)


def test_pointers_of_earlier_promotions_read_and_write_back_with_their_keys(local_layout):
    """Entries before evaluation samples (no eval_loss_se, eval_sample) still read; a pointer read and written again
    is the same JSON, with the samples' fields null where they were unknown (docs/CONTRACTS.md)."""
    entry, sampled = placed(ENTRY, local_layout), placed(SAMPLED, local_layout)
    stored = stored_pointer(sampled, [entry, sampled])
    write_json_atomic(local_layout.latest, stored)
    pointer = registry.read_latest(local_layout)
    assert (pointer.version, pointer.history[0].eval_sample, pointer.history[1].eval_loss_se) == ("v1", None, 0.01)
    assert pointer.to_xcom() == stored_pointer(sampled, [{**entry, "eval_loss_se": None, "eval_sample": None},
                                                         sampled])
    moved = registry.Pointer.moved_to(registry.Entry.from_xcom({**sampled, "version": "v2", "number": 2}),
                                      "gpt_finetune", pointer)
    assert [entry.version for entry in moved.history] == ["v1", "v1", "v2"] and moved.number == 2


@pytest.mark.parametrize(("where", "change", "named"), [
    ("top", {"model_url": "http://127.0.0.1:8/meta"}, ("Pointer.model_url = 'http://127.0.0.1:8/meta' (it must be "
                                                      "'{model}')")),
    ("top", {"url": "/home/airflow/.ssh"}, "Pointer.url = '/home/airflow/.ssh' (it must be '{url}')"),
    ("top", {"version": "v7"}, "Pointer.version = 'v7' (it must be 'v1')"),
    ("history", {"model_url": "s3://other/model"}, ("Pointer.history[0].model_url = 's3://other/model' (it must be "
                                                   "'{model}')")),
    ("top", {"number": 0}, "Pointer.number = 0 is no version number"),
])
def test_a_pointer_that_names_anything_but_its_version_s_folder_is_refused(local_layout, where, change, named):
    """Review t5 finding 2: latest.json is read by evaluate (which fetches and evaluates its model_url), prepare's
    `model: promoted` and promote; whoever writes storage must not steer any of them elsewhere."""
    entry = placed(ENTRY, local_layout)
    edited = {**entry, **change}
    stored = stored_pointer(edited, [entry]) if where == "top" else stored_pointer(entry, [edited])
    write_json_atomic(local_layout.latest, stored)
    with pytest.raises(registry.RegistryError) as refused:
        registry.read_latest(local_layout)
    version = local_layout.version(1)
    assert named.format(url=version.url, model=version.model) in str(refused.value)
    assert local_layout.latest in str(refused.value) and "restore it" in str(refused.value)


def test_a_claim_goes_above_every_claimed_number_and_ignores_other_files(layout):
    write_json_atomic(layout.claim(5), {"run_id": "killed mid-promotion"})
    write_bytes_atomic(join(layout.claims, "notes.txt"), b"not a claim")
    write_bytes_atomic(join(layout.claims, "vlatest.json"), b"{}")
    assert registry.claim_version(layout, 2, "r7") == 6
    assert registry.claim_version(layout, 9, "r8") == 10
    claim = read_json(layout.claim(6))
    assert (set(claim), claim["run_id"], claim["version"]) == ({"run_id", "claimed_at", "version"}, "r7", "v6")


def test_copy_into_copies_every_file_and_lists_its_size_from_the_version(root, layout):
    source = join(root, "runs", "r1", "train", "model")
    write_files(source, {"config.json": b"{}", "tf_model.h5": b"\0" * 1000, "tokenizer/vocab.json": b'{"a": 0}'})
    copied = registry.copy_into(layout.version(1), "model", source)
    assert copied == [registry.VersionFile("model/config.json", 2), registry.VersionFile("model/tf_model.h5", 1000),
                      registry.VersionFile("model/tokenizer/vocab.json", 8)]
    assert read_json(join(layout.version(1).model, "tokenizer", "vocab.json")) == {"a": 0}


def test_copy_into_of_a_model_that_was_never_saved_says_so(root, layout):
    with pytest.raises(FileNotFoundError, match="saved no model"):
        registry.copy_into(layout.version(1), "model", join(root, "runs", "r1", "train", "model"))


def test_a_version_is_complete_only_with_every_recorded_file_at_its_size(local_layout):
    version = local_layout.version(1)
    write_files(version.url, {"model/tf_model.h5": b"weights", "report.json": b"{}"})
    assert registry.complete_version(version) is None, "no version.json yet: the copy may still be running"
    # version.json as the first promotions wrote it: no evaluation sample, no base model.
    record = {"format_version": 1, "name": "gpt_finetune", "created_at": "2026-12-01T02:00:00+00:00",
              **{key: ENTRY[key] for key in ("version", "run_id", "run_key", "eval_loss", "perplexity",
                                             "dataset_fingerprint")},
              "files": [{"name": "model/tf_model.h5", "bytes": 7}, {"name": "report.json", "bytes": 2}]}
    write_json_atomic(version.record, record)
    complete = registry.complete_version(version)
    assert complete is not None and complete.to_xcom() == {**record, "eval_loss_se": None, "eval_sample": None,
                                                           "base_model": None, "adapter_base": None}
    pinned = {**record, "eval_loss_se": 0.01, "eval_sample": "s-1234",
              "base_model": {"name": "gpt2", "revision": "main", "sha": "a" * 40, "url": "models/base/gpt2@aaa"}}
    write_json_atomic(version.record, pinned)  # as promotions write it since the pinned base model
    complete = registry.complete_version(version)
    assert complete.base_model.sha == "a" * 40 and complete.to_xcom() == {**pinned, "adapter_base": None}
    write_bytes_atomic(join(version.url, "model", "tf_model.h5"), b"truncated")
    assert registry.complete_version(version) is None
    write_json_atomic(version.record, {**record, "files": [*record["files"], {"name": "model_card.md", "bytes": 1}]})
    assert registry.complete_version(version) is None
    write_json_atomic(version.record, {**record, "files": [{"name": "model/tf_model.h5", "bytes": "7"}]})
    damaged = re.escape("version.json: VersionRecord.files[0]: VersionFile.bytes: expected int")
    with pytest.raises(registry.RegistryError, match=damaged):
        registry.complete_version(version)


def tokenizer_json(vocab: dict[str, int], added: list[str]) -> bytes:
    return json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []},
                       "added_tokens": [{"id": len(vocab) + i, "content": token} for i, token in enumerate(added)],
                       "normalizer": None}).encode()


def test_same_tokenizer_compares_vocabulary_and_added_tokens(tmp_path):
    root = str(tmp_path)
    promoted, same, other_vocab, other_added = (join(root, name) for name in ("v1", "same", "vocab", "added"))
    write_files(promoted, {"tokenizer.json": tokenizer_json({"a": 0, "b": 1}, ["<|endoftext|>"])})
    # Settings outside the model and the added tokens do not change what the ids mean.
    write_files(same, {"tokenizer.json": tokenizer_json({"a": 0, "b": 1}, ["<|endoftext|>"]).replace(
        b'"normalizer": null', b'"normalizer": {"type": "NFC"}')})
    write_files(other_vocab, {"tokenizer.json": tokenizer_json({"a": 1, "b": 0}, ["<|endoftext|>"])})
    write_files(other_added, {"tokenizer.json": tokenizer_json({"a": 0, "b": 1}, ["<pad>"])})
    assert registry.same_tokenizer(promoted, same)
    assert not registry.same_tokenizer(promoted, other_vocab)
    assert not registry.same_tokenizer(promoted, other_added)
    assert not registry.same_tokenizer(promoted, join(root, "no-tokenizer-here"))


def test_a_tokenizer_saved_again_by_transformers_is_the_same_tokenizer(tmp_path):
    """transformers 5 writes a loaded BPE back with "" affixes and pair merges where the trained file had null and
    "a b" strings: promote and evaluate must still see one tokenizer (a continued run's ids mean the same)."""
    def tokenizer_dir(name: str, model: dict) -> str:
        url = str(tmp_path / name)
        write_json_atomic(join(url, "tokenizer.json"), {"model": model, "added_tokens": [{"id": 3, "content": "<e>"}]})
        return url

    vocab = {"a": 0, "b": 1, "ab": 2}
    trained = tokenizer_dir("trained", {"type": "BPE", "vocab": vocab, "merges": ["a b"],
                                        "continuing_subword_prefix": None, "end_of_word_suffix": None})
    saved_again = tokenizer_dir("saved", {"type": "BPE", "vocab": vocab, "merges": [["a", "b"]],
                                          "continuing_subword_prefix": "", "end_of_word_suffix": ""})
    other = tokenizer_dir("other", {"type": "BPE", "vocab": {**vocab, "ba": 3}, "merges": [["a", "b"]]})
    assert registry.same_tokenizer(trained, saved_again)
    assert not registry.same_tokenizer(trained, other)


def test_a_lora_versions_adapter_base_is_read_from_its_adapter_config_and_checked(tmp_path):
    from tasks.registry import AdapterBase, RegistryError, adapter_base

    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "base_model_name_or_path": "openai-community/gpt2", "revision": "c" * 40}))
    assert adapter_base(str(tmp_path)) == AdapterBase(base_model_name_or_path="openai-community/gpt2",
                                                      revision="c" * 40)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "gpt2"}))
    with pytest.raises(RegistryError, match="adapter_config.json.*revision"):
        adapter_base(str(tmp_path))
