"""tasks.registry on local disk and on the S3 server alike: a damaged pointer is named, claims are exclusive,
copies list their files, and a version counts only when every file it records is there. The exclusive create and
the compare-and-swap themselves are tested in tests/trainer/test_storage.py.

The promote task's use of it (the rule, races and kills) is tested in test_promote.py."""

from __future__ import annotations

import json

import pytest

from tasks import registry
from trainer.storage import join, read_json, write_bytes_atomic, write_json_atomic


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


@pytest.mark.parametrize(("stored", "problem"), [
    (b'{"version": "v1", "hist', "is not valid JSON"),
    (b'{"version": "v1"}', "no history list"),
    (b'["v1"]', "no history list"),
])
def test_a_damaged_pointer_is_an_error_that_names_it(layout, stored, problem):
    write_bytes_atomic(layout.latest, stored)
    with pytest.raises(registry.RegistryError, match=problem) as raised:
        registry.read_latest(layout)
    assert layout.latest in str(raised.value)


def test_a_claim_goes_above_every_claimed_number_and_ignores_other_files(layout):
    write_json_atomic(layout.claim(5), {"run_id": "killed mid-promotion"})
    write_bytes_atomic(join(layout.claims, "notes.txt"), b"not a claim")
    write_bytes_atomic(join(layout.claims, "vlatest.json"), b"{}")
    assert registry.claim_version(layout, 2, {"run_id": "r7"}) == 6
    assert registry.claim_version(layout, 9, {"run_id": "r8"}) == 10
    assert read_json(layout.claim(6)) == {"run_id": "r7", "version": "v6"}


def test_copy_tree_copies_every_file_and_lists_its_size(root, layout):
    source = join(root, "runs", "r1", "train", "model")
    write_files(source, {"config.json": b"{}", "tf_model.h5": b"\0" * 1000, "tokenizer/vocab.json": b'{"a": 0}'})
    copied = registry.copy_tree(source, layout.version(1).model)
    assert copied == [{"name": "config.json", "bytes": 2}, {"name": "tf_model.h5", "bytes": 1000},
                      {"name": "tokenizer/vocab.json", "bytes": 8}]
    assert read_json(join(layout.version(1).model, "tokenizer", "vocab.json")) == {"a": 0}


def test_copy_tree_of_a_model_that_was_never_saved_says_so(root, layout):
    with pytest.raises(FileNotFoundError, match="saved no model"):
        registry.copy_tree(join(root, "runs", "r1", "train", "model"), layout.version(1).model)


def test_a_version_is_complete_only_with_every_recorded_file_at_its_size(local_layout):
    version = local_layout.version(1)
    write_files(version.url, {"model/tf_model.h5": b"weights", "report.json": b"{}"})
    assert registry.complete_version(version) is None, "no version.json yet: the copy may still be running"
    record = {"version": "v1",
              "files": [{"name": "model/tf_model.h5", "bytes": 7}, {"name": "report.json", "bytes": 2}]}
    write_json_atomic(version.record, record)
    assert registry.complete_version(version) == record
    write_bytes_atomic(join(version.url, "model", "tf_model.h5"), b"truncated")
    assert registry.complete_version(version) is None
    write_json_atomic(version.record, {**record, "files": [*record["files"], {"name": "model_card.md", "bytes": 1}]})
    assert registry.complete_version(version) is None


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
