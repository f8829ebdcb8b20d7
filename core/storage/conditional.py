"""Conditional writes, for records that concurrent writers share without a lock server (the model registry's
version claims and its latest pointer): an exclusive create and a compare-and-swap, on local disk and on S3."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Iterator

import fsspec

from core.storage import filesystem, is_local, write_bytes_atomic


def read_with_token(url: str) -> tuple[bytes | None, str | None]:
    """The object's bytes and the token `compare_and_swap` needs to replace exactly them (S3: its ETag; local: the
    sha256 of its bytes); (None, None) when there is no object."""
    fs, path = filesystem(url)
    if is_local(fs):
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()
    try:
        etag = fs.info(path, refresh=True)["ETag"]
    except FileNotFoundError:
        return None, None
    # Read after the ETag: content newer than the token only makes a later swap fail, and the caller decide again.
    return fs.cat_file(path), etag


def compare_and_swap(url: str, expected_token: str | None, data: bytes) -> bool:
    """Write `data` only if the stored object is still the one `expected_token` names (`read_with_token`; None:
    still absent). True when written; False when another writer changed it first (read it again, decide again).

    Local: an atomic rename under an flock of `<path>.lock` (the kernel releases it when its holder dies). S3: one
    conditional PUT, `If-Match: <ETag>` or `If-None-Match: *` (AWS S3, MinIO and moto support both)."""
    fs, path = filesystem(url)
    if is_local(fs):
        with _local_lock(path + ".lock"):
            try:
                with open(path, "rb") as handle:
                    current = hashlib.sha256(handle.read()).hexdigest()
            except FileNotFoundError:
                current = None
            if current != expected_token:
                return False
            write_bytes_atomic(url, data)
            return True
    condition = {"IfMatch": expected_token} if expected_token else {"IfNoneMatch": "*"}
    try:
        written = _put_conditionally(fs, path, data, condition)
    except FileNotFoundError:  # If-Match on an object that was removed meanwhile
        return False
    fs.invalidate_cache(path)
    return written


def create_exclusive(url: str, data: bytes) -> bool:
    """Create `url` with `data` unless it exists; True when this call created it (local: `O_EXCL`; S3: a PUT with
    `If-None-Match: *`), so of concurrent callers exactly one gets True."""
    fs, path = filesystem(url)
    if is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        return True
    return _put_conditionally(fs, path, data, {"IfNoneMatch": "*"})


def _put_conditionally(fs: fsspec.AbstractFileSystem, path: str, data: bytes, condition: dict[str, str]) -> bool:
    """One conditional S3 PUT; False when another writer won: S3 answered 412 PreconditionFailed (s3fs raises
    FileExistsError for If-None-Match, a plain OSError for If-Match) or 409 ConditionalRequestConflict (a
    conditional write to the key in flight)."""
    bucket, key, _ = fs.split_path(path)
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
    except OSError as error:
        response = getattr(error.__cause__, "response", None)
        code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
        if isinstance(error, FileExistsError) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return False
        raise
    return True


@contextlib.contextmanager
def _local_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
