"""Reading the prepared dataset: manifest, each worker's shards, staging with verification, the tf.data pipeline.

Readers trust only `manifest.json` (see docs/CONTRACTS.md). Shards are copied to local disk and checked against
the manifest's size and sha256 before training starts, so a truncated or altered shard stops the run with the
file's name instead of corrupting it. The manifest itself is pinned like the run's configuration: the Airflow side
keeps the sha256 of the bytes it read when it laid out the run, the operator sets it on every worker as
`MANIFEST_SHA256_ENV`, and `load_manifest` refuses a manifest of another digest, so shards rewritten together with
their manifest entries are refused too. TensorFlow is imported inside `make_dataset` only: the task side imports
this module without paying for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core import storage
from core.layout import DATASET_FINGERPRINT, SHARD_NAME, SPLITS, TOKENIZER_DIR
from core.protocol import MANIFEST_SHA256_ENV
from trainer import runtime

FORMAT_VERSION = 1
_REQUIRED_KEYS = ("format_version", "fingerprint", "dtype", "block_size", "sequences_per_record", "tokenizer", "splits")
SHUFFLE_BUFFER_SEQUENCES = 8192


def token_dtype(vocab_size: int) -> str:
    """How prepare stores token ids, and what a manifest must say for its vocabulary: two bytes while every id fits,
    else four."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class DataError(RuntimeError):
    """The prepared dataset is missing, of another format, or damaged."""


def load_manifest(url: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The manifest at `url`, read once, its sha256 checked against the pin in `environ` (default: this process's;
    none: not checked, as on the Airflow side, which reads it with `read_manifest`) before it is parsed."""
    manifest, digest = read_manifest(url)
    pinned = (os.environ if environ is None else environ).get(MANIFEST_SHA256_ENV)
    if pinned is not None and digest != pinned:
        raise DataError(
            f"Manifest {url} has sha256 {digest}, but the Airflow side pinned {pinned or '(empty)'} "
            f"({MANIFEST_SHA256_ENV}) when it laid out the run: the manifest was changed since (anyone who can write "
            "the run's storage can do that), and with it what the shards may hold. Refusing it. Find out who wrote "
            "it, delete the dataset's directory and trigger a new run: prepare tokenizes the dataset again.")
    return manifest


def read_manifest(url: str) -> tuple[dict[str, Any], str]:
    """The manifest at `url`, checked for its format and names, and the sha256 of the bytes it was parsed from."""
    try:
        data = storage.read_bytes(url)
        manifest = json.loads(data.decode("utf-8"))
    except FileNotFoundError as error:
        raise DataError(
            f"Manifest {url} does not exist: the prepare task has not completed for this dataset. Run it again."
        ) from error
    except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep
        raise DataError(f"Manifest {url} is not readable JSON ({type(error).__name__}): it was not written by the "
                        "prepare task, or was altered since: delete its directory and prepare again.") from None
    if not isinstance(manifest, dict):
        raise DataError(f"Manifest {url} is a JSON {type(manifest).__name__}, not an object: delete its directory "
                        "and prepare again.")
    missing = [key for key in _REQUIRED_KEYS if key not in manifest]
    if missing:
        raise DataError(f"Manifest {url} lacks {missing}: it was not written by the prepare task. Prepare again.")
    if manifest["format_version"] != FORMAT_VERSION:
        raise DataError(
            f"Manifest {url} has format_version {manifest['format_version']}, this trainer reads {FORMAT_VERSION}: "
            "prepare the dataset again with this version."
        )
    problem = _names_problem(url, manifest)
    if problem:
        raise DataError(f"Manifest {url} is refused: {problem}. It was not written by the prepare task, or was "
                        "altered since: delete its directory and run the prepare task again.")
    return manifest, hashlib.sha256(data).hexdigest()


def _names_problem(url: str, manifest: dict[str, Any]) -> str | None:
    """What in the manifest's names could reach outside the dataset's directory or the shard cache, else None:
    its fingerprint names the cache directory, its shard names the files staged in it."""
    fingerprint, directory = manifest["fingerprint"], dataset_dir(url).rsplit("/", 1)[-1]
    if not isinstance(fingerprint, str) or not DATASET_FINGERPRINT.fullmatch(fingerprint):
        return f"fingerprint {fingerprint!r} is not {DATASET_FINGERPRINT.pattern}"
    if fingerprint != directory:
        return f"fingerprint {fingerprint!r} is not the name of its directory ({directory!r})"
    tokenizer = manifest["tokenizer"]
    if not isinstance(tokenizer, dict) or tokenizer.get("path") != TOKENIZER_DIR:
        return f"its tokenizer path is not {TOKENIZER_DIR!r}"
    splits = manifest["splits"]
    if not isinstance(splits, dict) or not set(splits) <= set(SPLITS):
        return f"its splits are not among {list(SPLITS)}"
    for split, entry in splits.items():
        shards = entry.get("shards") if isinstance(entry, dict) else None
        if not isinstance(shards, list):
            return f"split {split!r} has no list of shards"
        for shard in shards:
            problem = _shard_problem(shard)
            if problem:
                return f"split {split!r}: {problem}"
    return None


def _shard_problem(shard: Any) -> str | None:
    if not isinstance(shard, dict) or not isinstance(shard.get("name"), str):
        return f"shard entry {shard!r:.80} has no name"
    if not SHARD_NAME.fullmatch(shard["name"]):
        return f"shard name {shard['name']!r:.80} is not {SHARD_NAME.pattern}"
    size = shard.get("bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(shard.get("sha256"), str):
        return f"shard {shard['name']} has no byte count and sha256"
    return None


def dataset_dir(manifest_url: str) -> str:
    return manifest_url.rstrip("/").rsplit("/", 1)[0]


def tokenizer_url(manifest_url: str, manifest: dict[str, Any]) -> str:
    return storage.join(dataset_dir(manifest_url), manifest["tokenizer"]["path"])


def worker_shards(manifest: dict[str, Any], split: str, rank: int, num_workers: int) -> list[dict[str, Any]]:
    """This worker's shards: every `num_workers`-th from `rank`, so no file is read by two workers."""
    if split not in manifest["splits"]:
        raise DataError(f"The manifest has no split {split!r}; it has {sorted(manifest['splits'])}.")
    if not 0 <= rank < num_workers:
        raise DataError(f"Rank {rank} is outside a group of {num_workers} workers.")
    shards = manifest["splits"][split]["shards"]
    if len(shards) < num_workers:
        raise DataError(
            f"Split {split!r} has {len(shards)} shard(s) for {num_workers} workers: every worker needs its own. "
            "Prepare the dataset again with 'num_shards' >= 'num_workers'."
        )
    return shards[rank::num_workers]


SHARD_CACHE = "gpt-finetune-shards"


def shard_cache_root(base: str | Path | None = None) -> Path:
    """This user's shard cache on this host, one directory per dataset (not created here)."""
    return Path(base or runtime.host_temp_dir()) / f"{SHARD_CACHE}-{os.getuid()}"


def shard_cache_dir(fingerprint: str, base: str | Path | None = None) -> Path:
    """This user's cache of one dataset's shards: `<host tmp>/gpt-finetune-shards-<uid>/<fingerprint>`, mode 0700.

    In the host's temporary directory, not the worker's own (`launcher.tf_env.worker_temp_environment`):
    retries and the baseline reuse it; `trainer.shard_cache` holds it in use and evicts idle datasets for room.
    Private, so that no other user of the host can pre-create it, point it elsewhere, or swap a shard after its
    sha256 was checked."""
    if not isinstance(fingerprint, str) or not DATASET_FINGERPRINT.fullmatch(fingerprint):
        raise DataError(f"Dataset fingerprint {fingerprint!r} is not {DATASET_FINGERPRINT.pattern}: it would not "
                        "name one directory of the shard cache. Use the manifest prepare wrote (load_manifest).")
    root = shard_cache_root(base)
    private_dir(root)
    return private_dir(root / fingerprint)


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter: created with mode 0700, or an existing one accepted only
    when it is a real directory (no symbolic link) owned by this user, then narrowed to 0700."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise DataError(f"Shard cache {path} is a symbolic link or no directory: refusing it, since another user "
                        "may have put it there. Remove it, or point TMPDIR at a private directory.")
    if info.st_uid != os.getuid():
        raise DataError(f"Shard cache {path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): "
                        "refusing it. Remove it, or point TMPDIR at a private directory.")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def stage_shards(manifest_url: str, shards: Sequence[dict[str, Any]], local_dir: str | Path) -> list[str]:
    """Copy `shards` next to the worker and verify each against the manifest; returns the local paths.

    `local_dir` must be private to this user (see `private_dir`). A local copy that
    already matches is kept (restarts and the baseline reuse it); one that does not is fetched again. A shard that
    is still wrong after the download raises `DataError` naming it.
    """
    local_dir = Path(local_dir)
    local_dir.parent.mkdir(parents=True, exist_ok=True)
    private_dir(local_dir)
    source_dir = dataset_dir(manifest_url)
    staged = []
    for shard in shards:
        target = _staged_path(local_dir, shard)
        if not _matches(target, shard):
            url = storage.join(source_dir, shard["name"])
            partial = target.with_name(f".{target.name}.{os.getpid()}.part")
            try:
                storage.download_file(url, partial)
            except FileNotFoundError as error:
                raise DataError(
                    f"Shard {url} listed in {manifest_url} is missing: prepare the dataset again.") from error
            problem = _mismatch(partial, shard)
            if problem:
                partial.unlink(missing_ok=True)
                raise DataError(
                    f"Shard {url} is damaged: {problem}. Delete {source_dir} and run the prepare task again."
                )
            os.replace(partial, target)
        staged.append(str(target))
    return staged


def _staged_path(local_dir: Path, shard: dict[str, Any]) -> Path:
    """Where `shard` is staged: a file directly in `local_dir`, whatever the shard entry says."""
    problem = _shard_problem(shard)
    target = local_dir / shard["name"] if problem is None else None
    if target is None or target.resolve().parent != local_dir.resolve():
        raise DataError(f"Shard entry refused before staging into {local_dir}: "
                        f"{problem or 'it would be written outside that directory'}.")
    return target


def _matches(path: Path, shard: dict[str, Any]) -> bool:
    return path.is_file() and _mismatch(path, shard) is None


def _mismatch(path: Path, shard: dict[str, Any]) -> str | None:
    size = path.stat().st_size
    if size != shard["bytes"]:
        return f"{size} bytes where the manifest says {shard['bytes']}"
    digest = storage.sha256_file(path)
    if digest != shard["sha256"]:
        return f"sha256 {digest[:12]}... where the manifest says {shard['sha256'][:12]}..."
    return None


def make_dataset(
    files: Sequence[str],
    *,
    block_size: int,
    dtype: str,
    batch_size: int,
    shuffle: bool,
    seed: int,
    repeat: bool,
):
    """`tf.data.Dataset` of int32 `[batch_size, block_size]` token batches (inputs and labels are the same ids;
    the model shifts them). Full batches only, so every worker steps in lockstep."""
    import tensorflow as tf

    if not files:
        raise DataError("make_dataset got no shard files.")
    # uint32 ids are below 2**31 in any real vocabulary, so reading them as int32 keeps the bits and the value.
    raw_dtype = {"uint16": tf.uint16, "uint32": tf.int32}.get(dtype)
    if raw_dtype is None:
        raise DataError(f"Unknown token dtype {dtype!r} in the manifest: expected uint16 or uint32.")

    names = tf.data.Dataset.from_tensor_slices(list(files))
    if shuffle:
        names = names.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
    records = names.interleave(
        tf.data.TFRecordDataset, cycle_length=min(len(files), 4), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )

    def decode(record):
        ids = tf.io.decode_raw(record, raw_dtype, little_endian=True)
        return tf.reshape(tf.cast(ids, tf.int32), [-1, block_size])

    sequences = records.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
    if repeat:
        sequences = sequences.repeat()
    if shuffle:
        sequences = sequences.shuffle(SHUFFLE_BUFFER_SEQUENCES, seed=seed, reshuffle_each_iteration=True)
    return sequences.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)


__all__ = ["DataError", "load_manifest", "make_dataset", "stage_shards", "tokenizer_url", "worker_shards"]
