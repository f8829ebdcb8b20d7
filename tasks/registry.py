"""The model registry: promoted versions of a named model under `<root>/models/<name>/` and its `latest` pointer.

    latest.json            the pointer, the one record readers trust: the current version and the history
    claims/v<N>.json       created exclusively: version number N belongs to one promotion
    v<N>/model/            save_pretrained model and tokenizer
    v<N>/report.json, v<N>/model_card.md
    v<N>/version.json      written last in the version: every file with its size

Concurrent promotions (runs of other DAGs or deployments on the same storage) need no lock server: a version
number is claimed by an exclusive create, and the pointer moves only by compare-and-swap from the pointer the
promotion decided against (S3: a conditional PUT with If-Match / If-None-Match; local disk: an atomic rename under
an flock, which the kernel releases when the holder dies). The pointer is written after the version is complete,
so a promotion killed at any point leaves `latest` on a complete version; its half-written `v<N>/` is in no
history and is never read. Importable without Airflow and TensorFlow (the UI plugin reads it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import posixpath
from collections.abc import Iterator
from typing import Any

from trainer.layout import ModelLayout, StorageLayout, VersionLayout
from trainer.storage import exists, filesystem, is_local, join, list_dir, read_json, write_json_atomic

POINTER_FORMAT_VERSION = 1
MAX_CLAIM_ATTEMPTS = 1000


class RegistryError(RuntimeError):
    """The registry cannot be read or written as promised (a malformed pointer, a swap that keeps losing)."""


def model_layout(storage_root: str, name: str) -> ModelLayout:
    return StorageLayout(storage_root).model(name)


# ---------------------------------------------------------------------------------------------------------------
# the pointer


def read_latest(layout: ModelLayout) -> dict[str, Any] | None:
    """The pointer of a registered model, or None when nothing was promoted under that name."""
    return read_pointer(layout.latest)[0]


def read_pointer(url: str) -> tuple[dict[str, Any] | None, str | None]:
    """The pointer and the token a swap from it needs (S3: its ETag; local: the sha256 of its bytes)."""
    fs, path = filesystem(url)
    if is_local(fs):
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return None, None
        return _parse_pointer(url, data), hashlib.sha256(data).hexdigest()
    try:
        etag = fs.info(path, refresh=True)["ETag"]
    except FileNotFoundError:
        return None, None
    # Read after the ETag: content newer than the token only makes the later swap fail and decide again.
    return _parse_pointer(url, fs.cat_file(path)), etag


def _parse_pointer(url: str, data: bytes) -> dict[str, Any]:
    try:
        pointer = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise RegistryError(f"{url} is not valid JSON ({error}): the registry pointer is damaged.") from error
    if not isinstance(pointer, dict) or not isinstance(pointer.get("history"), list):
        raise RegistryError(f"{url} is not a registry pointer (no history list).")
    return pointer


def swap_pointer(url: str, expected_token: str | None, pointer: dict[str, Any]) -> bool:
    """Write `pointer` only if the stored one is still the one `expected_token` names (None: still absent).

    True when written; False when another promotion moved it first (read it again and decide again)."""
    data = (json.dumps(pointer, indent=2, sort_keys=True) + "\n").encode("utf-8")
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
            write_json_atomic(url, pointer)
            return True
    bucket, key, _ = fs.split_path(path)
    condition = {"IfMatch": expected_token} if expected_token else {"IfNoneMatch": "*"}
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, ContentType="application/json", **condition)
    except FileNotFoundError:  # If-Match on a pointer that was removed meanwhile
        return False
    except OSError as error:
        if _condition_failed(error):
            return False
        raise
    fs.invalidate_cache(path)
    return True


def _condition_failed(error: OSError) -> bool:
    """Another writer won: S3 answered 412 PreconditionFailed (s3fs raises FileExistsError for If-None-Match, a
    plain OSError for If-Match) or 409 ConditionalRequestConflict (a conditional write to the key in flight)."""
    if isinstance(error, FileExistsError):
        return True
    response = getattr(error.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in ("PreconditionFailed", "ConditionalRequestConflict")


@contextlib.contextmanager
def _local_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------------------------
# versions


def create_exclusive(url: str, payload: dict[str, Any]) -> bool:
    """Create `url` with `payload` unless it exists; True when this call created it."""
    data = (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode("utf-8")
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
    bucket, key, _ = fs.split_path(path)
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, ContentType="application/json", IfNoneMatch="*")
    except OSError as error:
        if _condition_failed(error):
            return False
        raise
    return True


def claim_version(layout: ModelLayout, above: int, claim: dict[str, Any]) -> int:
    """The lowest free version number above `above` and every claimed one, now owned by the caller."""
    claimed = [int(name[1:-5]) for name in list_dir(layout.claims)
               if name.startswith("v") and name.endswith(".json") and name[1:-5].isdigit()]
    number = max([above, *claimed]) + 1
    for _ in range(MAX_CLAIM_ATTEMPTS):
        if create_exclusive(layout.claim(number), {**claim, "version": f"v{number}"}):
            return number
        number += 1
    raise RegistryError(f"No free version number under {layout.claims} after {MAX_CLAIM_ATTEMPTS} attempts.")


def copy_tree(source_url: str, target_url: str) -> list[dict[str, Any]]:
    """Copy every file under `source_url` to `target_url` within one storage (S3: server-side); returns the files
    with their sizes, relative to `target_url`."""
    fs, source = filesystem(source_url)
    _, target = filesystem(target_url)
    files = sorted(fs.find(source))
    if not files:
        raise FileNotFoundError(f"{source_url} has no files: the run saved no model there.")
    copied = []
    for remote in files:
        relative = posixpath.relpath(remote, source)
        destination = f"{target.rstrip('/')}/{relative}"
        if is_local(fs):
            os.makedirs(os.path.dirname(destination), exist_ok=True)
        fs.copy(remote, destination)
        copied.append({"name": relative, "bytes": fs.size(remote)})
    return copied


def same_tokenizer(model_url: str, tokenizer_dir_url: str) -> bool:
    """Whether two save_pretrained directories hold the same fast tokenizer (vocabulary, merges, special tokens),
    so that one's token ids mean the same to the other."""
    def identity(url: str) -> Any:
        spec = read_json(join(url, "tokenizer.json"))
        return spec.get("model"), spec.get("added_tokens")

    try:
        return identity(model_url) == identity(tokenizer_dir_url)
    except (FileNotFoundError, ValueError):
        return False


def complete_version(version: VersionLayout) -> dict[str, Any] | None:
    """version.json when the version and every file it lists exist, else None."""
    if not exists(version.record):
        return None
    record = read_json(version.record)
    fs, root = filesystem(version.url)
    for file in record.get("files", []):
        path = f"{root.rstrip('/')}/{file['name']}"
        if not fs.exists(path) or fs.size(path) != file["bytes"]:
            return None
    return record



__all__ = ["RegistryError", "claim_version", "complete_version", "copy_tree", "create_exclusive", "model_layout",
           "read_latest", "read_pointer", "swap_pointer"]
