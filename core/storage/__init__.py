"""Object storage through fsspec: local paths, file:// and s3:// alike.

Only this package tells local paths from object storage (`is_local`): callers ask for what they need (a local copy
to read, a local place to write and publish, a stage beside the target; an exclusive create and a compare-and-swap
in `core.storage.conditional`) and never branch on where the URL points.

Credentials never travel in URLs, configs or argv. For S3 they come from the environment that botocore reads
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3,
AWS_DEFAULT_REGION); the Airflow side turns a Connection into those variables (see `tasks.connections`).
Importable without Airflow and without TensorFlow.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs
from fsspec.utils import get_protocol

_OBJECT_STORES_KEPT = 8  # distinct AWS_* environments (credentials, endpoints) one process uses at a time
_OBJECT_STORES: dict[tuple, fsspec.AbstractFileSystem] = {}
_OBJECT_STORES_LOCK = threading.Lock()


def _forget_object_stores() -> None:
    global _OBJECT_STORES_LOCK
    _OBJECT_STORES.clear()
    _OBJECT_STORES_LOCK = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_object_stores)


def storage_options_from_env(url: str) -> dict[str, Any]:
    """fsspec options for `url`; for s3 the endpoint comes from the environment (botocore reads the keys)."""
    if not url.startswith("s3://"):
        return {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for `url` and the path inside it: a fresh local one, or an object store's reused while this
    process's AWS_* environment stays the same (`_object_store`). Object stores cache no listings: other processes
    write the same prefixes, and a stale listing would make `exists` lie."""
    options = storage_options_from_env(url)
    if get_protocol(url) not in ("file", "local"):
        options["use_listings_cache"] = False
    fs, path = url_to_fs(url, skip_instance_cache=True, **options)
    return (fs if is_local(fs) else _object_store(fs)), path


def _object_store(fresh: fsspec.AbstractFileSystem) -> fsspec.AbstractFileSystem:
    """An earlier filesystem made with `fresh`'s options under this process's AWS_* environment, else `fresh`,
    kept for the next call. (A new one costs nothing until its first call makes its botocore client.)

    A botocore client costs about 0.2 s of CPU to make: one per storage call cost more than the calls. fsspec's
    own instance cache cannot be used: botocore reads the keys from the environment, which
    `tasks.connections.with_storage_credentials` changes for a block, so a filesystem is reused only under the
    environment it was made in (keyed by a digest: no secret is held as a key). A forked child starts empty
    (fsspec's event loop does not survive a fork)."""
    environment = sorted((name, value) for name, value in os.environ.items() if name.startswith("AWS_"))
    key = (fresh._fs_token, hashlib.sha256(json.dumps(environment).encode()).hexdigest())
    with _OBJECT_STORES_LOCK:
        cached = _OBJECT_STORES.pop(key, fresh)
        _OBJECT_STORES[key] = cached  # most recently used last
        while len(_OBJECT_STORES) > _OBJECT_STORES_KEPT:
            del _OBJECT_STORES[next(iter(_OBJECT_STORES))]
        return cached


def join(base: str, *parts: str) -> str:
    """Join URL or path parts with '/', keeping the scheme of `base`."""
    return posixpath.join(base.rstrip("/"), *[p.strip("/") for p in parts])


def normalize_root(root: str, relative_to: str | Path | None = None) -> str:
    """A storage root as an absolute path or URL; relative local paths are taken from `relative_to`/cwd."""
    if "://" in root:
        return root.rstrip("/")
    path = Path(root).expanduser()
    if not path.is_absolute():
        path = Path(relative_to or Path.cwd()) / path
    return str(path.resolve())


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    """The whole object at `url` in one request: one version even while a writer replaces it (a file handle's
    reads would ask for the version it opened, and fail once that is gone)."""
    fs, path = filesystem(url)
    return fs.cat_file(path)


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of the object at `url` (one ranged request on object stores)."""
    fs, path = filesystem(url)
    return fs.cat_file(path, start=start, end=end)


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url).decode("utf-8"))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "file" in protocols


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write so that readers see the old object or the complete new one, never a part.

    Local files are written to a temporary name and renamed; an S3 PUT is atomic by itself.
    """
    fs, path = filesystem(url)
    if is_local(fs):
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        return
    with fs.open(path, "wb") as handle:
        handle.write(data)


def write_json_atomic(url: str, payload: Any) -> None:
    write_bytes_atomic(url, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's bytes, read into one reused buffer (no new bytes object per read)."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def upload_file(local_path: str | Path, url: str) -> None:
    fs, path = filesystem(url)
    if is_local(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    fs.put_file(str(local_path), path)


def download_file(url: str, local_path: str | Path) -> None:
    fs, path = filesystem(url)
    Path(local_path).parent.mkdir(parents=True, exist_ok=True)
    fs.get_file(path, str(local_path))


def upload_tree(local_dir: str | Path, url: str) -> list[str]:
    """Copy every file under `local_dir` to `url`, keeping relative paths; returns the URLs written.

    One client and one batched `put` for the whole tree: object stores then upload the files concurrently,
    and no client is built per file.
    """
    files = sorted(file for file in Path(local_dir).rglob("*") if file.is_file())
    if not files:
        return []
    fs, root = filesystem(url)
    relative = [file.relative_to(local_dir).as_posix() for file in files]
    if is_local(fs):
        for name in {os.path.dirname(name) for name in relative}:
            os.makedirs(os.path.join(root, name), exist_ok=True)
    fs.put([str(file) for file in files], [f"{root.rstrip('/')}/{name}" for name in relative])
    return [join(url, name) for name in relative]


def download_tree(url: str, local_dir: str | Path) -> list[Path]:
    """Copy every object under `url` into `local_dir`; returns the local files."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        return []
    local = []
    for remote in sorted(fs.find(path)):
        relative = posixpath.relpath(remote, path)
        target = Path(local_dir) / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(target))
        local.append(target)
    return local


def copy_tree(source_url: str, target_url: str) -> list[dict[str, Any]]:
    """Copy every file under `source_url` to `target_url` within one storage (S3: server-side); returns the files
    with their sizes, relative to `target_url`. FileNotFoundError when there is none."""
    fs, source = filesystem(source_url)
    _, target = filesystem(target_url)
    files = sorted(fs.find(source))
    if not files:
        raise FileNotFoundError(f"{source_url} has no files")
    copied = []
    for remote in files:
        relative = posixpath.relpath(remote, source)
        destination = f"{target.rstrip('/')}/{relative}"
        if is_local(fs):
            os.makedirs(os.path.dirname(destination), exist_ok=True)
        fs.copy(remote, destination)
        copied.append({"name": relative, "bytes": fs.size(remote)})
    return copied


def local_copy(url: str, scratch: str | Path) -> Path:
    """`url` (a file or a directory) as a local path to read: its own path when it is on this machine, else
    `scratch/<its name>`, where it is downloaded. A missing `url` gives a path that does not exist."""
    fs, path = filesystem(url)
    if is_local(fs):
        return Path(path)
    copy = Path(scratch) / posixpath.basename(path.rstrip("/"))
    if fs.isfile(path):
        download_file(url, copy)
    else:
        download_tree(url, copy)
    return copy


def local_target(url: str, scratch: str | Path) -> Path:
    """A local path to write what `url` will hold: its own path when it is on this machine, else
    `scratch/<its name>` (nothing downloaded); `publish_files` then makes the files written there `url`'s."""
    fs, path = filesystem(url)
    return Path(path) if is_local(fs) else Path(scratch) / posixpath.basename(path.rstrip("/"))


def publish_files(local_dir: str | Path, url: str, names: list[str] | None = None) -> None:
    """Upload the files `names` (relative to `local_dir`, in this order: the last one, an index, lands last) or,
    without `names`, every file under it, to the same names under `url`. Nothing to do when `local_dir` is `url`'s
    own directory (`local_copy`, `local_target`)."""
    fs, path = filesystem(url)
    if is_local(fs) and Path(path).resolve() == Path(local_dir).resolve():
        return
    if names is None:
        upload_tree(local_dir, url)
        return
    for name in names:
        upload_file(Path(local_dir) / name, join(url, name))


def remove_empty_directory(url: str) -> None:
    """Remove the directory `url` when it is empty (another writer's files keep it). Object stores have no
    directories: a prefix is gone with its last object, so there is nothing to do."""
    fs, path = filesystem(url)
    if is_local(fs):
        with contextlib.suppress(OSError):  # not empty, or already gone
            os.rmdir(path)


def remove_tree(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def list_dir(url: str) -> Iterator[str]:
    """Names directly under `url` (files and folders), sorted; nothing when it does not exist."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        return iter(())
    return iter(sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(path, detail=False)))


@contextlib.contextmanager
def staging_directory(url: str) -> Iterator[Path]:
    """A local directory to build what `url` will hold, for `publish_directory`. For a local `url` it sits beside
    the target (the same filesystem, so publishing is one rename), named after its host and process; what killed
    builds of this target left there is removed first: a stage of this host whose process is gone, or any stage
    untouched for STALE_STAGE_S. A live build's stage (another run preparing the same dataset) stays: only its
    owner removes it. Else a temporary directory. Whatever is left of it is removed on exit."""
    fs, target = filesystem(url)
    if is_local(fs):
        parent, name = Path(target).parent, Path(target).name
        parent.mkdir(parents=True, exist_ok=True)
        for stale in parent.glob(f".{name}.partial-*"):
            if _stale_stage(stale, f".{name}.partial-"):
                shutil.rmtree(stale, ignore_errors=True)
        stage = parent / f".{name}.partial-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
    else:
        stage = Path(tempfile.mkdtemp(prefix=f"stage-{posixpath.basename(target.rstrip('/'))}-"))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


STALE_STAGE_S = 24 * 3600  # a stage untouched this long was left by a build that died, on whatever host


def _stale_stage(stage: Path, prefix: str) -> bool:
    """Whether a `.<name>.partial-<host>-<pid>-<id>` stage was left by a build that ended."""
    parts = stage.name[len(prefix):].rsplit("-", 2)  # the host name may hold '-', the pid and the id do not
    host, pid = (parts[0], parts[1]) if len(parts) == 3 else (socket.gethostname(), parts[0])  # <pid>-<id>: older
    if host == socket.gethostname() and pid.isdigit():
        return not pid_alive(int(pid))
    try:
        return time.time() - stage.stat().st_mtime > STALE_STAGE_S
    except FileNotFoundError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has this pid (another user's counts; no /proc needed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish_file(path: Path, url: str) -> None:
    """Make the local file `path` the object at `url`: one rename when `url` is local (stage it on the same
    filesystem), else one upload (an object PUT is atomic by itself)."""
    fs, target = filesystem(url)
    if is_local(fs):
        os.replace(path, target)
    else:
        upload_file(path, url)


def publish_directory(stage: Path, url: str, *, last: tuple[str, bytes] | None = None) -> None:
    """Make the files of `stage` (from `staging_directory(url)`) what `url` holds, replacing an earlier copy,
    complete or interrupted. `last` (a name and its bytes) is the file whose presence tells readers the rest is
    complete, such as a manifest: it is written after everything else.

    Local: `last` goes into the stage, then one rename. Object storage: the earlier objects are removed, the tree
    uploaded, then `last` in one PUT (atomic by itself)."""
    fs, target = filesystem(url)
    if is_local(fs):
        if last:
            write_bytes_atomic(str(stage / last[0]), last[1])
        if os.path.lexists(target):
            shutil.rmtree(target)
        os.replace(stage, target)
        return
    if fs.exists(target):
        fs.rm(target, recursive=True)
    upload_tree(stage, url)
    if last:
        fs.pipe_file(f"{target.rstrip('/')}/{last[0]}", last[1])
