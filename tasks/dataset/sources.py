"""Where the prepare stage's documents come from: the `dataset` setting resolved into files.

`dataset` is a local path, a `file://` or `s3://` URL (a file, a directory or a glob) of `.txt`, `.jsonl`/`.json`
(JSON Lines) or `.parquet` files, or a hub dataset id when the machine is online (resolved to the dataset's data
files at one revision, read through `hf://` like any other URL). Only metadata is read here: size and mtime (they
go into the fingerprint, and a file that changes while the stage reads it fails the stage) and each file's path
relative to the dataset's base, which keys its documents' draws (`tasks.dataset.split`).
"""

from __future__ import annotations

import glob
import os
import posixpath
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from core.config import ConfigError
from core.config.access import DATA_ROOTS_ENV, AccessPolicy
from core.document import Document
from core.storage import filesystem
from tasks.dataset.errors import SourceError

KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
# A hub dataset's data files, most preferred first: the hub converts most datasets to Parquet.
HUB_PREFERENCE = ("parquet", "jsonl", "text")
_GLOB_CHARS = re.compile(r"[*?\[]")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class SourceFile(Document):
    """A source file as the plan saw it (in the fingerprint, the plan and the manifest's `sources`)."""

    url: str
    size: int
    mtime: str
    relpath: str  # from the dataset's base (the part of the setting before any glob): keys the document draws


@dataclass(frozen=True)
class Sources:
    """The resolved input: every file and the kind of reader they need (text | jsonl | parquet)."""

    spec: str
    kind: str
    files: tuple[SourceFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def names(self, limit: int = 3) -> str:
        names = [f.url for f in self.files]
        return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def resolve_sources(spec: str, repo_root: Path, policy: AccessPolicy | None = None) -> Sources:
    """Expand `spec` into concrete files with size, mtime and relative path. With `policy`, each local file is held
    to the data roots as it resolves through symlinks: the policy's check of the setting sees only the directory a
    glob searches, and a link under it may lead anywhere."""
    if spec.startswith("s3://"):
        files = _remote_files(spec)
    elif spec.startswith("file://"):
        files = _local_files(spec[len("file://"):], spec, policy)
    elif _is_hub_id(spec, repo_root):
        files = _hub_files(spec)
    else:
        path = Path(spec).expanduser()
        if not path.is_absolute() and not glob.glob(str(path)):
            path = repo_root / path  # relative settings are relative to the repository, wherever Airflow runs
        files = _local_files(str(path), spec, policy)

    if not files:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} matches no {'/'.join(sorted(KINDS))} file. Check the path or glob "
            "(relative paths are taken from the repository root) and that the files exist."
        )
    unsupported = [f.url for f in files if _suffix(f.url) not in KINDS]
    if unsupported:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} matches files of unsupported type, e.g. {unsupported[0]}: "
            f"use {', '.join(sorted(KINDS))} files or narrow the glob."
        )
    kinds = {KINDS[_suffix(f.url)] for f in files}
    if len(kinds) > 1:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} mixes file types ({', '.join(sorted(kinds))}): point it at one kind."
        )
    return Sources(spec=spec, kind=kinds.pop(), files=tuple(files))


def _check_resolved(match: Path, real: Path, spec: str, policy: AccessPolicy) -> None:
    try:
        policy.check("dataset", str(real), hub_ids=False)
    except ConfigError:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} matches {str(match)!r}, which resolves through a symlink to {real}, "
            f"outside the allowed data roots {list(policy.data_roots)}: remove the link or copy the file under a "
            f"root, or have the operator add its directory to ${DATA_ROOTS_ENV} (':'-separated).") from None


def check_unchanged(source: SourceFile) -> None:
    """Fail, naming the file, when it is no longer what the plan read: nothing built from it may be published."""
    if source.url.startswith("hf://"):
        return  # pinned to a revision: its files never change
    fs, path = filesystem(source.url)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        raise SourceError(f"Source file {source.url} disappeared while the dataset was being prepared: nothing "
                          "was published. Run again once the corpus is stable.") from None
    size, mtime = int(info.get("size") or 0), _mtime(info)
    if size != source.size or (source.mtime and mtime != source.mtime):
        raise SourceError(
            f"Source file {source.url} changed while the dataset was being prepared (planned: {source.size} bytes, "
            f"modified {source.mtime}; now {size} bytes, modified {mtime}): nothing was published. Run again once "
            "the corpus is stable; the new contents get a new fingerprint.")


def _suffix(url: str) -> str:
    return posixpath.splitext(url)[1].lower()


def _static_base(pattern: str) -> str:
    """The directory part of a path pattern before its first glob character."""
    parts = pattern.split("/")
    for index, part in enumerate(parts):
        if _GLOB_CHARS.search(part):
            return "/".join(parts[:index])
    return pattern


def _local_files(pattern: str, spec: str, policy: AccessPolicy | None) -> list[SourceFile]:
    path = Path(pattern)
    if _GLOB_CHARS.search(pattern):
        candidates = [Path(p) for p in glob.glob(pattern, recursive=True)]
        base = Path(_static_base(pattern) or ".").resolve()
    elif path.is_dir():
        candidates = [p for p in path.rglob("*") if p.suffix.lower() in KINDS]
        base = path.resolve()
    elif path.exists():
        candidates, base = [path], path.resolve().parent
    else:
        raise SourceError(
            f"Setting 'dataset' = {spec!r}: {path} does not exist. Check the path (relative paths are taken from "
            "the repository root)."
        )
    files = []
    for match in (p for p in candidates if policy is not None and p.is_file()):
        _check_resolved(match, match.resolve(), spec, policy)
    for candidate in sorted(p.resolve() for p in candidates if p.is_file()):
        stat = candidate.stat()
        files.append(SourceFile(str(candidate), stat.st_size, _iso(stat.st_mtime),
                                os.path.relpath(candidate, base)))
    return files


def _remote_files(spec: str) -> list[SourceFile]:
    fs, path = filesystem(spec)
    try:
        if _GLOB_CHARS.search(path):
            infos, base = fs.glob(path, detail=True), _static_base(path)
        elif fs.isdir(path):
            infos = {p: i for p, i in fs.find(path, detail=True).items() if _suffix(p) in KINDS}
            base = path
        else:
            infos, base = {path: fs.info(path)}, posixpath.dirname(path)
    except FileNotFoundError as error:
        raise SourceError(f"Setting 'dataset' = {spec!r}: {spec} does not exist ({error}).") from error
    except PermissionError as error:
        raise SourceError(
            f"Setting 'dataset' = {spec!r}: access denied ({error}). Check the storage connection's credentials."
        ) from error
    return [SourceFile(f"s3://{name}", int(infos[name].get("size") or 0), _mtime(infos[name]),
                       posixpath.relpath(name, base.rstrip("/") or "/"))
            for name in sorted(infos) if infos[name].get("type") != "directory"]


def _is_hub_id(spec: str, repo_root: Path) -> bool:
    if "://" in spec or _GLOB_CHARS.search(spec) or Path(spec).suffix.lower() in KINDS:
        return False
    if Path(spec).expanduser().exists() or (repo_root / spec).exists():
        return False
    return bool(_HUB_ID.match(spec))


def _hub_files(spec: str, api: Any = None) -> list[SourceFile]:
    """The hub dataset's data files at its current revision, as `hf://` URLs pinned to that revision (one kind:
    Parquet when there is any, else JSON Lines, else text)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    try:
        info = (api or HfApi()).dataset_info(spec, files_metadata=True)
    except OfflineModeIsEnabled as error:
        raise SourceError(
            f"Setting 'dataset' = {spec!r} is neither an existing path nor reachable: it looks like a hub dataset "
            "id but the hub is offline (HF_HUB_OFFLINE). Use local or s3:// files, or run where the hub is online."
        ) from error
    except Exception as error:
        raise SourceError(f"Setting 'dataset' = {spec!r}: no such local path, and the hub lookup failed: {error}") \
            from error
    modified = info.last_modified.isoformat() if info.last_modified else ""
    by_kind: dict[str, list[Any]] = {}
    for sibling in info.siblings or ():
        kind = KINDS.get(_suffix(sibling.rfilename))
        if kind:
            by_kind.setdefault(kind, []).append(sibling)
    kind = next((k for k in HUB_PREFERENCE if k in by_kind), None)
    if kind is None:
        raise SourceError(f"Hub dataset {spec!r} (revision {info.sha}) has no {'/'.join(sorted(KINDS))} data files.")
    return [SourceFile(f"hf://datasets/{spec}@{info.sha}/{s.rfilename}", int(s.size or 0), modified, s.rfilename)
            for s in sorted(by_kind[kind], key=lambda s: s.rfilename)]


def _mtime(info: dict[str, Any]) -> str:
    modified = info.get("LastModified") or info.get("mtime") or ""
    if isinstance(modified, (int, float)):
        return _iso(modified)
    return modified.isoformat() if hasattr(modified, "isoformat") else str(modified)


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=UTC).isoformat()
