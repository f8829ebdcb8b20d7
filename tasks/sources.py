"""Where the prepare stage's documents come from: resolving the `dataset` setting and reading its documents.

`dataset` is a local path, a `file://` or `s3://` URL (a file, a directory or a glob) of `.txt`, `.jsonl`/`.json`
or `.parquet` files, or a hub dataset id when the machine is online. Plain text files are split into documents
at blank lines (paragraphs), read here; structured files give one document per row of `text_column`, read with
HF datasets. Object-storage files are downloaded with `trainer.storage`, whose S3 endpoint and credentials come
from the environment only.
"""

from __future__ import annotations

import glob
import logging
import re
from dataclasses import asdict, dataclass
from datetime import UTC
from pathlib import Path
from typing import Any

from trainer.storage import download_file, filesystem

log = logging.getLogger("gpt_finetune.prepare")

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_GLOB_CHARS = re.compile(r"[*?\[]")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
TEXT = "text"


class SourceError(ValueError):
    """The dataset setting names nothing usable: missing files, unsupported or mixed formats, bad contents."""


@dataclass(frozen=True)
class SourceFile:
    url: str
    size: int
    mtime: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Sources:
    """The resolved input: every file (or the hub dataset) and the `datasets` builder that reads them."""

    spec: str
    builder: str  # text | json | parquet | hub
    files: tuple[SourceFile, ...]


def resolve_sources(spec: str, repo_root: Path) -> Sources:
    """Expand `spec` into concrete files with size and mtime (these go into the fingerprint)."""
    if spec.startswith("s3://"):
        files = _remote_files(spec)
    elif spec.startswith("file://"):
        files = _local_files(spec[len("file://"):], spec)
    elif _is_hub_id(spec, repo_root):
        return _hub_sources(spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute() and not glob.glob(str(path)):
            path = repo_root / path  # relative settings are relative to the repository, wherever Airflow runs
        files = _local_files(str(path), spec)

    if not files:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} matches no {'/'.join(sorted(BUILDERS))} file. Check the path or glob "
            "(relative paths are taken from the repository root) and that the files exist."
        )
    kinds = {BUILDERS.get(Path(f.url).suffix.lower()) for f in files}
    unsupported = [f.url for f in files if Path(f.url).suffix.lower() not in BUILDERS]
    if unsupported:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} matches files of unsupported type, e.g. {unsupported[0]}: "
            f"use {', '.join(sorted(BUILDERS))} files or narrow the glob."
        )
    if len(kinds) > 1:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} mixes file types ({', '.join(sorted(kinds))}): point it at one kind."
        )
    return Sources(spec=spec, builder=kinds.pop(), files=tuple(files))


def _local_files(pattern: str, spec: str) -> list[SourceFile]:
    path = Path(pattern)
    if _GLOB_CHARS.search(pattern):
        candidates = [Path(p) for p in glob.glob(pattern, recursive=True)]
    elif path.is_dir():
        candidates = [p for p in path.rglob("*") if p.suffix.lower() in BUILDERS]
    elif path.exists():
        candidates = [path]
    else:
        raise SourceError(
            f"Setting 'dataset' = {spec!r}: {path} does not exist. Check the path (relative paths are taken from "
            "the repository root)."
        )
    files = []
    for candidate in sorted(p.resolve() for p in candidates if p.is_file()):
        stat = candidate.stat()
        files.append(SourceFile(str(candidate), stat.st_size, _iso_mtime(stat.st_mtime)))
    return files


def _remote_files(spec: str) -> list[SourceFile]:
    fs, path = filesystem(spec)
    try:
        if _GLOB_CHARS.search(path):
            infos = fs.glob(path, detail=True)
        elif fs.isdir(path):
            infos = {p: i for p, i in fs.find(path, detail=True).items() if Path(p).suffix.lower() in BUILDERS}
        else:
            infos = {path: fs.info(path)}
    except FileNotFoundError as error:
        raise SourceError(f"Setting 'dataset' = {spec!r}: {spec} does not exist ({error}).") from error
    except PermissionError as error:
        raise SourceError(
            f"Setting 'dataset' = {spec!r}: access denied ({error}). Check the storage connection's credentials."
        ) from error
    files = []
    for name in sorted(infos):
        info = infos[name]
        if info.get("type") == "directory":
            continue
        modified = info.get("LastModified") or info.get("mtime") or ""
        mtime = modified.isoformat() if hasattr(modified, "isoformat") else str(modified)
        files.append(SourceFile(f"s3://{name}", int(info.get("size") or 0), mtime))
    return files


def _is_hub_id(spec: str, repo_root: Path) -> bool:
    if "://" in spec or _GLOB_CHARS.search(spec) or Path(spec).suffix.lower() in BUILDERS:
        return False
    if Path(spec).expanduser().exists() or (repo_root / spec).exists():
        return False
    return bool(_HUB_ID.match(spec))


def _hub_sources(spec: str) -> Sources:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        info = HfApi().dataset_info(spec)
    except OfflineModeIsEnabled as error:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} is neither an existing path nor reachable: it looks like a hub dataset "
            "id but the hub is offline (HF_HUB_OFFLINE). Use local or s3:// files, or run where the hub is online."
        ) from error
    except Exception as error:
        raise SourceError(f"Setting 'dataset' = {spec!r}: no such local path, and the hub lookup failed: {error}") from error
    modified = info.last_modified.isoformat() if info.last_modified else ""
    return Sources(spec=spec, builder="hub", files=(SourceFile(f"hf://datasets/{spec}@{info.sha}", 0, modified),))


def load_documents(sources: Sources, text_column: str, cache_dir: Path) -> list[str]:
    """The documents, one string each, in a stable order (file by file, then row or paragraph order).

    Plain text is read here directly: a paragraph is what `datasets`' text builder with `sample_by="paragraph"`
    yields (universal newlines, split at blank lines, empty pieces dropped), without its multi-second import and
    Arrow cache. Structured files and hub datasets go through `datasets`.
    """
    if sources.builder == "text":
        return _text_paragraphs(sources, cache_dir / "sources")
    dataset = _load_with_datasets(sources, text_column, cache_dir)
    return [text or "" for text in dataset.data.column(TEXT).to_pylist()]


def _text_paragraphs(sources: Sources, directory: Path) -> list[str]:
    documents: list[str] = []
    for source, path in zip(sources.files, _local_copies(sources, directory), strict=True):
        data = Path(path).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise SourceError(_not_utf8(source.url, data, bad)) from bad
        if "\r" in text:  # what open()'s universal newlines do
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        documents += [paragraph for paragraph in text.split("\n\n") if paragraph]
    return documents


def _load_with_datasets(sources: Sources, text_column: str, cache_dir: Path):
    """A `datasets.Dataset` with one string column `text`, one row per document."""
    import datasets

    datasets.disable_progress_bars()
    options: dict[str, Any] = {"cache_dir": str(cache_dir), "split": "train"}
    if sources.builder == "hub":
        name, revision = sources.files[0].url.removeprefix("hf://datasets/").rsplit("@", 1)
        dataset = datasets.load_dataset(name, revision=revision, **options)
    else:
        options["data_files"] = _local_copies(sources, cache_dir / "sources")
        try:
            dataset = datasets.load_dataset(sources.builder, **options)
        except Exception as error:
            _raise_for_contents(sources, error)
            raise
    if text_column not in dataset.column_names:
        raise SourceError(
            f"Setting 'text_column' = {text_column!r} is not a column of {sources.spec!r}: the columns are "
            f"{dataset.column_names}. Set 'text_column' to the one holding the text."
        )
    dataset = dataset.select_columns([text_column])
    if text_column != TEXT:
        dataset = dataset.rename_column(text_column, TEXT)
    if dataset.features[TEXT].dtype not in ("string", "large_string"):
        raise SourceError(
            f"Column {text_column!r} of {sources.spec!r} holds {dataset.features[TEXT].dtype}, not text: "
            "set 'text_column' to a string column."
        )
    return dataset


def _local_copies(sources: Sources, directory: Path) -> list[str]:
    """Local paths of the sources; object-storage files are downloaded first (with the environment's endpoint
    and credentials), which also works where `datasets` runs offline."""
    paths = []
    for index, source in enumerate(sources.files):
        if "://" not in source.url:
            paths.append(source.url)
            continue
        target = directory / f"{index:05d}-{Path(source.url).name}"
        download_file(source.url, target)
        paths.append(str(target))
    return paths


def _raise_for_contents(sources: Sources, error: BaseException) -> None:
    """Turn a failure deep inside `datasets` into one that names the file; returns when the cause is unknown."""
    from datasets.arrow_writer import SchemaInferenceError

    chain, cause = [], error
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    # datasets reports files without a single row as a schema it cannot infer, or a split without data.
    if any(isinstance(c, SchemaInferenceError) or "corresponds to no data" in str(c) for c in chain):
        raise SourceError(f"Dataset {sources.spec!r} has no documents: no rows in {_names(sources)}.") from error
    cause = next((c for c in chain if isinstance(c, UnicodeDecodeError)), None)
    if cause is None or sources.builder == "parquet":
        return
    for source in sources.files:
        fs, path = filesystem(source.url)
        with fs.open(path, "rb") as handle:
            data = handle.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise SourceError(_not_utf8(source.url, data, bad)) from error
    raise SourceError(f"A source file of {sources.spec!r} is not valid UTF-8 ({cause}).") from error


def _not_utf8(url: str, data: bytes, bad: UnicodeDecodeError) -> str:
    return (
        f"Source file {url} is not valid UTF-8: byte 0x{data[bad.start]:02x} at offset {bad.start}. "
        "Re-encode it as UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or remove it from 'dataset'."
    )


def _names(sources: Sources) -> str:
    names = [f.url for f in sources.files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _iso_mtime(timestamp: float) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(timestamp, tz=UTC).isoformat()


__all__ = ["TEXT", "SourceError", "SourceFile", "Sources", "load_documents", "resolve_sources"]
