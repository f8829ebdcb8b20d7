"""The access policy, held again on the Airflow side to every configuration a task reads back from XCom or storage.

Prepare checks the trigger's settings once (`RunConfig.from_params`), but whoever may edit XCom or write the run's
storage could hand a later task another configuration. Each task that acts on one re-checks it here, where the
policy's environment is; the workers have no such environment and load what this side checked, pinned by its digest
(trainer/config/pinned.py). The operator also holds the storage URLs it launches workers with to the run's layout.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from trainer.config import ConfigError, RunConfig
from trainer.config.access import AccessPolicy
from trainer.layout import DATASET_FINGERPRINT, RunLayout, StorageLayout, absolute_root


def checked_config(saved: Mapping[str, Any]) -> RunConfig:
    """A configuration read back from XCom or storage, held to the access policy of this (Airflow) process again:
    a rewritten one reaches no further than the trigger form could. AirflowFailException naming the setting."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return RunConfig.from_saved(saved, policy=AccessPolicy.from_env())
    except ConfigError as error:
        raise AirflowFailException(f"The prepared run's configuration is refused: {error}") from error


# The worker arguments that name storage, and where in the run's own layout each may point.
LAUNCH_URL_FLAGS = ("--config", "--manifest", "--output")


def check_launch_urls(args: Sequence[str], storage_root: str, key: str) -> None:
    """The storage URLs a worker group is launched with (its `--config`, `--manifest` and `--output`, rendered
    from XCom) lie in this run's own layout under its policy-checked `storage_root` (trainer/layout.py): the run's
    config.json or baseline_config.json, a dataset's manifest.json, a directory of the run or of a baseline.
    ConfigError naming the argument, the URL and the places allowed: an edited XCom launches nothing elsewhere."""
    layout = StorageLayout(absolute_root(storage_root))
    run = layout.run(key)
    for flag, url in itertools.pairwise(str(arg) for arg in args):
        if flag in LAUNCH_URL_FLAGS and not _in_layout(flag, url, layout, run):
            where = {"--config": f"{run.config} or {run.baseline_config}",
                     "--manifest": layout.manifest("<fingerprint>"),
                     "--output": f"a directory under {run.url} or {layout.baseline('<baseline_key>').url}"}[flag]
            raise ConfigError(
                f"the worker argument {flag} {url!r} is outside this run's storage layout: it must be {where} (the "
                f"run key {key!r} is derived from the task's own DAG run; storage_root {storage_root!r}). The "
                "prepared run's XCom was changed, or the DAG passes another path: launch with the prepared run's "
                "URLs.")


def _in_layout(flag: str, url: str, layout: StorageLayout, run: RunLayout) -> bool:
    parts = url.split("/")
    if ".." in parts or "." in parts or url.endswith("/"):
        return False
    if flag == "--config":
        return url in (run.config, run.baseline_config)
    if flag == "--manifest":
        return len(parts) > 1 and bool(DATASET_FINGERPRINT.fullmatch(parts[-2])) and url == layout.manifest(parts[-2])
    baseline = url.removeprefix(layout.baselines + "/")
    return url.startswith(run.url + "/") or (baseline != url and "/" not in baseline)
