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
history and is never read. The exclusive create and the compare-and-swap are `trainer.storage`'s. Importable
without Airflow and TensorFlow (the UI plugin reads it).
"""

from __future__ import annotations

import json
from typing import Any

from trainer.layout import ModelLayout, StorageLayout, VersionLayout
from trainer.storage import (
    compare_and_swap,
    create_exclusive,
    exists,
    filesystem,
    join,
    list_dir,
    read_json,
    read_with_token,
)
from trainer.storage import copy_tree as storage_copy_tree

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
    """The pointer and the token a swap from it needs (`trainer.storage.read_with_token`)."""
    data, token = read_with_token(url)
    return (None, None) if data is None else (_parse_pointer(url, data), token)


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
    return compare_and_swap(url, expected_token, _json_bytes(pointer))


def _json_bytes(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------------------------
# versions


def claim_version(layout: ModelLayout, above: int, claim: dict[str, Any]) -> int:
    """The lowest free version number above `above` and every claimed one, now owned by the caller."""
    claimed = [int(name[1:-5]) for name in list_dir(layout.claims)
               if name.startswith("v") and name.endswith(".json") and name[1:-5].isdigit()]
    number = max([above, *claimed]) + 1
    for _ in range(MAX_CLAIM_ATTEMPTS):
        if create_exclusive(layout.claim(number), _json_bytes({**claim, "version": f"v{number}"})):
            return number
        number += 1
    raise RegistryError(f"No free version number under {layout.claims} after {MAX_CLAIM_ATTEMPTS} attempts.")


def copy_tree(source_url: str, target_url: str) -> list[dict[str, Any]]:
    """Copy a run's saved model to a version within one storage (S3: server-side); the files with their sizes."""
    try:
        return storage_copy_tree(source_url, target_url)
    except FileNotFoundError:
        raise FileNotFoundError(f"{source_url} has no files: the run saved no model there.") from None


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



__all__ = ["RegistryError", "claim_version", "complete_version", "copy_tree", "model_layout", "read_latest",
           "read_pointer", "swap_pointer"]
