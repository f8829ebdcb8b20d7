"""A saved run configuration, pinned by the digest of its bytes from the Airflow side's check to the worker's read.

The Airflow side holds a configuration to the access policy and then writes it to the run's storage (prepare's
config.json and baseline_config.json, the elastic train task's config-N-workers.json); the workers read it from
there. Anyone who can write the bucket (every worker host holds its credentials) could change `model`, `dataset`,
... in between, and a worker holds no policy to check them against. So each writer keeps the sha256 of the exact
bytes it wrote (`save_config`) and hands it on (the prepared run's XCom; the elastic operator knows its own); the
operator sets it on every worker of the group as `CONFIG_SHA256_ENV`, and every worker entry point loads its
configuration through `load_pinned_config`, which refuses a file of another digest before parsing it.

Without the variable (a worker started by hand, the bench scripts) the file is loaded as it is and a warning says
so: the operator always sets it, so only a launch from outside the pipeline goes unpinned. Set but different
(empty included) is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping

from core import storage
from core.config import RunConfig
from core.config.core import ConfigError
from core.protocol import CONFIG_SHA256_ENV

log = logging.getLogger("core.config")


class ConfigChangedError(ConfigError):
    """The configuration file is not the one the Airflow side checked: a retry reads the same file, so it is a
    permanent failure (the train entry point exits EXIT_PERMANENT on every ConfigError)."""


def config_bytes(cfg: RunConfig) -> bytes:
    return (cfg.to_json() + "\n").encode("utf-8")


def save_config(url: str, cfg: RunConfig) -> str:
    """Write `cfg` at `url` (atomically) and return the sha256 of the bytes written: the digest to pin."""
    data = config_bytes(cfg)
    storage.write_bytes_atomic(url, data)
    return hashlib.sha256(data).hexdigest()


def load_pinned_config(url: str, environ: Mapping[str, str] | None = None) -> RunConfig:
    """The configuration at `url`, read once; its sha256 checked against the pinned one in `environ` (default: this
    process's) before it is parsed. ConfigChangedError naming the file and both digests on a mismatch."""
    data = storage.read_bytes(url)
    pinned = (os.environ if environ is None else environ).get(CONFIG_SHA256_ENV)
    if pinned is None:
        log.warning("%s is not pinned (no %s in the environment: a worker started outside the pipeline): loading it "
                    "as it is", url, CONFIG_SHA256_ENV)
    else:
        actual = hashlib.sha256(data).hexdigest()
        if actual != pinned:
            raise ConfigChangedError(
                f"the run configuration {url} has sha256 {actual}, but the Airflow side pinned {pinned or '(empty)'} "
                f"({CONFIG_SHA256_ENV}) when it checked and wrote it: the file was changed after the Airflow side "
                "checked it (anyone who can write the run's storage can do that). Refusing to run it. Find out who "
                "wrote it, then trigger a new run: prepare checks and writes the configuration again.")
    try:
        saved = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"the run configuration {url} is not JSON: {error}") from None
    if not isinstance(saved, Mapping):
        raise ConfigError(f"the run configuration {url} must be a JSON object, got {type(saved).__name__}")
    return RunConfig.from_saved(saved)
