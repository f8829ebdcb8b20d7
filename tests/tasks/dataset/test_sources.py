"""Resolving the `dataset` setting: paths relative to the dataset's base (they key the draws), and a hub dataset
resolved to its data files at one revision (against a stand-in for the hub's API: this machine is offline)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from tasks.dataset.errors import SourceError
from tasks.dataset.sources import _hub_files, resolve_sources
from tests.tasks.dataset.corpus import REPO


def test_relative_paths_start_at_the_part_of_the_setting_before_any_glob(tmp_path):
    (tmp_path / "corpus" / "a").mkdir(parents=True)
    (tmp_path / "corpus" / "a" / "x.txt").write_text("x")
    (tmp_path / "corpus" / "y.txt").write_text("y")
    by_glob = resolve_sources(str(tmp_path / "corpus" / "**" / "*.txt"), REPO)
    assert [f.relpath for f in by_glob.files] == ["a/x.txt", "y.txt"]
    assert [f.relpath for f in resolve_sources(str(tmp_path / "corpus"), REPO).files] == ["a/x.txt", "y.txt"]
    assert [f.relpath for f in resolve_sources(str(tmp_path / "corpus" / "y.txt"), REPO).files] == ["y.txt"]


class _Hub:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def dataset_info(self, name: str, files_metadata: bool):
        assert files_metadata
        siblings = [SimpleNamespace(rfilename=n, size=100 + i) for i, n in enumerate(self.names)]
        return SimpleNamespace(sha="abc123", siblings=siblings, last_modified=datetime(2026, 11, 1, tzinfo=UTC))


def test_a_hub_dataset_is_its_parquet_files_pinned_to_a_revision():
    files = _hub_files("someone/corpus", _Hub(["README.md", "data/train-00001.parquet", "data/train-00000.parquet",
                                               "raw/extra.jsonl"]))
    assert [f.url for f in files] == ["hf://datasets/someone/corpus@abc123/data/train-00000.parquet",
                                      "hf://datasets/someone/corpus@abc123/data/train-00001.parquet"]
    assert [f.relpath for f in files] == ["data/train-00000.parquet", "data/train-00001.parquet"]
    assert files[0].size == 102 and files[0].mtime == "2026-11-01T00:00:00+00:00"
    assert [f.url.rsplit("/", 1)[1] for f in _hub_files("someone/corpus", _Hub(["a.jsonl", "b.txt"]))] == ["a.jsonl"]
    with pytest.raises(SourceError, match=r"has no .* data files"):
        _hub_files("someone/corpus", _Hub(["README.md"]))


def test_a_glob_match_that_a_symlink_leads_out_of_the_data_roots_is_refused(tmp_path):
    """Review t5, finding 7: the policy checks the directory a glob searches; a link under it led prepare to
    tokenize a file outside every data root."""
    from core.config import AccessPolicy

    uploads, outside = tmp_path / "uploads", tmp_path / "outside"
    uploads.mkdir()
    outside.mkdir()
    (uploads / "corpus.txt").write_text("fine")
    (outside / "secret.txt").write_text("the host's file")
    (uploads / "notes.txt").symlink_to(outside / "secret.txt")
    policy = AccessPolicy(data_roots=(str(uploads),), s3_buckets=frozenset())
    policy.check("dataset", str(uploads / "*.txt"), hub_ids=True)  # the setting itself passes, as in the review
    assert len(resolve_sources(str(uploads / "*.txt"), REPO).files) == 2  # no policy: what prepare read before
    for spec in (str(uploads / "*.txt"), str(uploads)):
        with pytest.raises(SourceError) as refused:
            resolve_sources(spec, REPO, policy)
        assert str(refused.value) == (
            f"Setting 'dataset' = {spec!r} matches {str(uploads / 'notes.txt')!r}, which resolves through a symlink to "
            f"{outside / 'secret.txt'}, outside the allowed data roots {[str(uploads)]}: remove the link or copy the "
            "file under a root, or have the operator add its directory to $GPT_FINETUNE_DATA_ROOTS (':'-separated).")
    (uploads / "notes.txt").unlink()
    (uploads / "inside.txt").symlink_to(uploads / "corpus.txt")  # a link that stays inside a root is fine
    assert [f.relpath for f in resolve_sources(str(uploads / "*.txt"), REPO, policy).files] == ["corpus.txt",
                                                                                              "corpus.txt"]
