"""The access policy: what a run's settings may reach, set by the operator through the environment.

`dataset`, `model`, `tokenizer` and `storage_root` may name only presets, hub ids, local paths under the data roots
and `s3://` buckets on the allow-list. Every other scheme (`http://`, ...) and every `..` is refused, so that a user
who may trigger runs cannot make the workers fetch URLs or read files of the host.

The settings that choose what runs and with which credentials (the image, namespace and service account of pods,
the connections of every role, the SSH hosts' interpreter, the alert recipients) may name only what the operator's
allow-lists hold; each list defaults to the deployment's own value (the setting's default), never to anything.
An empty setting (no connection: the environment's own; the namespace's default account; the same interpreter as
here) names nothing of the user's choosing and always passes.
"""

from __future__ import annotations

import glob
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from core import REPO_ROOT
from core.config.core import ConfigError, is_email_address

DATA_ROOTS_ENV = "GPT_FINETUNE_DATA_ROOTS"
S3_BUCKETS_ENV = "GPT_FINETUNE_S3_BUCKETS"
STORAGE_ROOT_ENV = "GPT_FINETUNE_STORAGE_ROOT"
IMAGE_PREFIXES_ENV = "GPT_FINETUNE_IMAGE_PREFIXES"
NAMESPACES_ENV = "GPT_FINETUNE_NAMESPACES"
SERVICE_ACCOUNTS_ENV = "GPT_FINETUNE_SERVICE_ACCOUNTS"
STORAGE_CONN_IDS_ENV = "GPT_FINETUNE_STORAGE_CONN_IDS"
KUBERNETES_CONN_IDS_ENV = "GPT_FINETUNE_KUBERNETES_CONN_IDS"
SSH_CONN_IDS_ENV = "GPT_FINETUNE_SSH_CONN_IDS"
ALERT_CONN_IDS_ENV = "GPT_FINETUNE_ALERT_CONN_IDS"
REMOTE_PYTHONS_ENV = "GPT_FINETUNE_REMOTE_PYTHONS"
ALERT_DOMAINS_ENV = "GPT_FINETUNE_ALERT_DOMAINS"
REMOTE_WORKDIRS_ENV = "GPT_FINETUNE_REMOTE_WORKDIRS"
# The allow-lists: run setting -> (AccessPolicy field, its variable, what it lists).
ALLOW_LISTS = {
    "image": ("image_prefixes", IMAGE_PREFIXES_ENV, "images"),
    "namespace": ("namespaces", NAMESPACES_ENV, "Kubernetes namespaces"),
    "service_account": ("service_accounts", SERVICE_ACCOUNTS_ENV, "service accounts"),
    "kubernetes_conn_id": ("kubernetes_conn_ids", KUBERNETES_CONN_IDS_ENV, "Kubernetes connections"),
    "storage_conn_id": ("storage_conn_ids", STORAGE_CONN_IDS_ENV, "storage connections"),
    "ssh_conn_ids": ("ssh_conn_ids", SSH_CONN_IDS_ENV, "SSH connections"),
    "remote_python": ("remote_pythons", REMOTE_PYTHONS_ENV, "remote interpreters"),
    "alert_conn_id": ("alert_conn_ids", ALERT_CONN_IDS_ENV, "alert connections"),
    "alert_emails": ("alert_domains", ALERT_DOMAINS_ENV, "recipient domains"),
    "remote_workdir": ("remote_workdirs", REMOTE_WORKDIRS_ENV, "remote work directories"),
}
# The operator's ceilings: run setting -> (AccessPolicy field, its variable). A run may ask for less, never more;
# `max_run_cost` with a ceiling may not be 0 (off) either. `tolerationSeconds` bounds each pod toleration's.
CEILINGS = {
    "bpe_sample_mb": ("max_bpe_sample_mb", "GPT_FINETUNE_MAX_BPE_SAMPLE_MB"),
    "hang_timeout_s": ("max_hang_timeout_s", "GPT_FINETUNE_MAX_HANG_TIMEOUT_S"),
    "tolerationSeconds": ("max_toleration_s", "GPT_FINETUNE_MAX_TOLERATION_S"),
    "max_run_cost": ("max_run_cost", "GPT_FINETUNE_MAX_RUN_COST"),
}
_IMAGE_BOUNDARIES = "/:@"  # where a prefix may end inside an image reference: a path, a tag, a digest
_IMAGE_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a Docker tag
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # `gpt2`, `openai-community/gpt2`
_URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: not a drive letter
_GLOB_CHARS = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class AccessPolicy:
    """What run settings may reach, set by the operator through the environment (never by a run setting).

    data_roots: local directories that `dataset`, `model`, `tokenizer` and `storage_root` may lie under
        ($GPT_FINETUNE_DATA_ROOTS, separated by ':'; default: the repository's data/ and the storage root,
        $GPT_FINETUNE_STORAGE_ROOT or <repo>/storage). Relative entries are taken from the repository.
    s3_buckets: buckets that `s3://` settings may name ($GPT_FINETUNE_S3_BUCKETS, comma-separated; empty: any).

    The allow-lists (`ALLOW_LISTS`; comma-separated variables, unset or empty: the default here) hold exact values
    or shell patterns (`tfmw_ssh_*`); `image_prefixes` holds prefixes of image references that end at a '/', ':'
    or '@' (`registry.example.com/ml` allows `registry.example.com/ml/trainer:1`, not `registry.example.com/ml-x`),
    and `alert_domains` the domains of recipients (case-insensitive, `*.example.com` for subdomains).

    The ceilings (`CEILINGS`; unset or empty variable: the default here) bound what a run may ask of the Airflow
    worker's memory (`bpe_sample_mb`), how long a silent group may hold its GPUs (`hang_timeout_s`) and a pod stay
    bound to a failed node (`tolerationSeconds`), and the predicted cost preflight lets a run start at
    (`max_run_cost`; none by default).
    """

    data_roots: tuple[str, ...]
    s3_buckets: frozenset[str]
    image_prefixes: tuple[str, ...] = ("gpt-finetune-trainer:",)  # the trainer image, any tag (RunConfig's default)
    namespaces: tuple[str, ...] = ("default",)
    service_accounts: tuple[str, ...] = ()
    kubernetes_conn_ids: tuple[str, ...] = ()
    storage_conn_ids: tuple[str, ...] = ()
    ssh_conn_ids: tuple[str, ...] = ()
    remote_pythons: tuple[str, ...] = ()
    alert_conn_ids: tuple[str, ...] = ()
    alert_domains: tuple[str, ...] = ()
    remote_workdirs: tuple[str, ...] = ()
    max_bpe_sample_mb: float = 1024
    max_hang_timeout_s: float = 6 * 3600
    max_toleration_s: float = 3600
    max_run_cost: float | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> AccessPolicy:
        configured = environ.get(DATA_ROOTS_ENV, "").strip()
        entries = configured.split(os.pathsep) if configured else [
            "data", environ.get(STORAGE_ROOT_ENV, "").strip() or "storage"]
        roots = tuple(os.path.realpath(REPO_ROOT / Path(entry.strip()).expanduser())
                      for entry in entries if entry.strip() and "://" not in entry)
        buckets = frozenset(b.strip() for b in environ.get(S3_BUCKETS_ENV, "").split(",") if b.strip())
        defaults = {spec.name: spec.default for spec in fields(cls)}
        allow_lists = {}
        for field_name, variable, _ in ALLOW_LISTS.values():
            entries = tuple(entry.strip() for entry in environ.get(variable, "").split(",") if entry.strip())
            allow_lists[field_name] = entries or defaults[field_name]
        ceilings = {field_name: _ceiling(environ, variable, defaults[field_name])
                    for field_name, variable in CEILINGS.values()}
        return cls(roots, buckets, **allow_lists, **ceilings)

    def check_settings(self, cfg: Any) -> None:
        """Refuse a RunConfig whose `dataset`, `storage_root`, `model` or `tokenizer` reaches beyond this policy (a
        model preset or `promoted`, and a `bpe:<n>` tokenizer, reach nothing), or whose execution and credential
        settings are outside the allow-lists. A backend's own settings are checked when the run uses that backend."""
        self.check("dataset", cfg.dataset, hub_ids=True)
        self.check("storage_root", cfg.storage_root, hub_ids=False)
        if cfg.promoted_source is None and not cfg.is_preset_model:
            self.check("model", cfg.model, hub_ids=True)
        if not cfg.tokenizer.startswith("bpe:"):
            self.check("tokenizer", cfg.tokenizer, hub_ids=True)
        for name, value in _execution_settings(cfg):
            self.check_allowed(name, value)
        for name, value in _ceiling_settings(cfg):
            self.check_ceiling(name, value)

    def check_ceiling(self, name: str, value: float) -> None:
        """Refuse `value` of setting `name` above the operator's ceiling (`CEILINGS`); a `max_run_cost` of 0 (off)
        when the operator set one."""
        field_name, variable = CEILINGS[name]
        ceiling = getattr(self, field_name)
        if ceiling is None or 0 < value <= ceiling or value == 0 < ceiling and name != "max_run_cost":
            return
        off = " (0 turns the budget off, which this deployment does not allow)" if name == "max_run_cost" else ""
        shown = value if isinstance(value, int) else f"{value:g}"
        raise ConfigError(
            f"Setting '{name}' = {shown} is outside what this deployment allows{off} ({variable}={ceiling:g}): use "
            f"a value {'above 0 and ' if name == 'max_run_cost' else ''}at most {ceiling:g}, or have the operator "
            f"raise ${variable} (see docs/security.md).")

    def check_allowed(self, name: str, value: str) -> None:
        """Refuse `value` of execution or credential setting `name` (one entry of a list setting) unless its
        allow-list holds it; an empty value passes."""
        if not value:
            return
        if name in ("remote_python", "remote_workdir"):
            _refuse_parent_steps(name, value)
        field_name, variable, listed = ALLOW_LISTS[name]
        entries = getattr(self, field_name)
        if not any(_matches(name, value, entry) for entry in entries):
            subject = f"has {value!r}, which" if name in ("ssh_conn_ids", "alert_emails") else f"= {value!r}"
            raise ConfigError(
                f"Setting '{name}' {subject} is outside the {listed} this deployment allows "
                f"({variable}={','.join(entries) or '(none)'}): use one of those, or have the operator add it to "
                f"${variable} (comma-separated, see docs/security.md).")

    def check(self, name: str, value: str, *, hub_ids: bool) -> None:
        """Refuse `value` of setting `name` unless it is a hub id (when `hub_ids`), an allowed bucket or a path
        under a data root. Presets are the caller's business."""
        _refuse_parent_steps(name, value)
        scheme = _URL_SCHEME.match(value)
        if scheme or "://" in value:
            kind = (scheme.group(1) if scheme else "").lower()
            if kind == "s3":
                return self._check_bucket(name, value)
            if kind == "file" and value.startswith("file:///"):
                return self._check_path(name, value[len("file://"):])
            raise ConfigError(
                f"Setting '{name}' = {value!r} uses the scheme '{kind}', which is not allowed: use a local path under "
                f"{list(self.data_roots)} (or file:///...), an s3:// URL"
                + (", or a hub id" if hub_ids else "") + "."
            )
        if hub_ids and is_hub_id(value):
            return None
        return self._check_path(name, value, from_repo=name == "storage_root")

    def _check_bucket(self, name: str, value: str) -> None:
        bucket = urlparse(value).netloc
        if not bucket:
            raise ConfigError(f"Setting '{name}' = {value!r} names no bucket: write s3://<bucket>/<path>.")
        if self.s3_buckets and bucket not in self.s3_buckets:
            raise ConfigError(
                f"Setting '{name}' = {value!r}: bucket '{bucket}' is not allowed; allowed buckets are "
                f"{sorted(self.s3_buckets)} (${S3_BUCKETS_ENV})."
            )

    def _check_path(self, name: str, value: str, *, from_repo: bool = False) -> None:
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = REPO_ROOT / path if from_repo else _local_candidate(value)
        # A glob is checked by the directory it searches; symlinks are followed, so a link out of a root is refused.
        fixed = Path(*[part for part in path.parts[:next(
            (i for i, part in enumerate(path.parts) if _GLOB_CHARS.search(part)), len(path.parts))]])
        real = os.path.realpath(fixed)
        if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in self.data_roots):
            raise ConfigError(
                f"Setting '{name}' = {value!r} is outside the allowed data roots {list(self.data_roots)}: move it "
                f"under one of them, or have the operator add its directory to ${DATA_ROOTS_ENV} (':'-separated)."
            )


def _execution_settings(cfg: Any) -> list[tuple[str, str]]:
    """(setting, value) of every execution and credential setting the run uses, one pair per list entry."""
    chosen = [("storage_conn_id", cfg.storage_conn_id), ("alert_conn_id", cfg.monitoring.alert_conn_id)]
    chosen += [("alert_emails", address) for address in cfg.monitoring.alert_emails]
    if cfg.launch.backend == "kubernetes":
        pods = ("image", "namespace", "service_account", "kubernetes_conn_id")
        chosen += [(name, getattr(cfg.launch.kubernetes, name)) for name in pods]
    if cfg.launch.backend == "ssh":
        chosen += [("ssh_conn_ids", conn_id) for conn_id in cfg.launch.ssh.ssh_conn_ids]
        chosen.append(("remote_python", cfg.launch.ssh.remote_python))
        chosen.append(("remote_workdir", cfg.launch.ssh.remote_workdir))
    return chosen


def _ceiling_settings(cfg: Any) -> list[tuple[str, float]]:
    """(setting, value) of every setting the operator's ceilings bound, one pair per pod toleration's seconds."""
    chosen = [("bpe_sample_mb", cfg.bpe_sample_mb), ("hang_timeout_s", cfg.launch.hang_timeout_s),
              ("max_run_cost", cfg.monitoring.max_run_cost)]
    if cfg.launch.backend == "kubernetes":
        chosen += [("tolerationSeconds", toleration["tolerationSeconds"])
                   for toleration in cfg.launch.kubernetes.tolerations if "tolerationSeconds" in toleration]
    return chosen


def _ceiling(environ: Mapping[str, str], variable: str, default: float | None) -> float | None:
    configured = environ.get(variable, "").strip()
    if not configured:
        return default
    try:
        value = float(configured)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"${variable} = {configured!r} is not a ceiling: set a positive number, or unset it for "
                          f"the default ({'none' if default is None else f'{default:g}'}).")
    return value


def _refuse_parent_steps(name: str, value: str) -> None:
    if ".." in re.split(r"[/\\]", value):
        raise ConfigError(f"Setting '{name}' = {value!r} contains '..': name the location without it.")


def _matches(name: str, value: str, entry: str) -> bool:
    """Whether allow-list `entry` of setting `name` admits `value`."""
    if name == "image":
        return _image_matches(value, entry)
    if name == "alert_emails":  # a plain address whose domain is an entry, or a subdomain of a `*.<domain>` entry
        domain, entry = value.rpartition("@")[2].lower(), entry.lower()
        return is_email_address(value) and (domain.endswith(entry[1:]) if entry.startswith("*.") else domain == entry)
    return fnmatchcase(value, entry)


def _image_matches(value: str, entry: str) -> bool:
    """A prefix that ends at a boundary of the reference, never inside a name; after a ':' only a tag may follow
    (`name:` admits `name:2.21`, never `name:5000/other/image`, a registry at port 5000)."""
    if not value.startswith(entry):
        return False
    rest = value[len(entry):]
    if entry.endswith(":"):
        return bool(_IMAGE_TAG.fullmatch(rest))
    return not rest or entry[-1] in _IMAGE_BOUNDARIES or rest[0] in _IMAGE_BOUNDARIES


def is_hub_id(value: str) -> bool:
    """A scheme-less setting that names a model or tokenizer on the hub (`gpt2`), not a local path that exists."""
    return bool(_HUB_ID.fullmatch(value)) and not _local_candidate(value).exists()


def _local_candidate(value: str) -> Path:
    """The path a relative setting names, as the stages resolve it: from the cwd when it exists there, else from
    the repository."""
    path = Path(value).expanduser()
    if path.is_absolute() or glob.glob(str(path)):
        return path.absolute()
    return REPO_ROOT / path
