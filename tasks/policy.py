"""The access policy, held again on the Airflow side to every configuration a task reads back from XCom or storage.

Prepare checks the trigger's settings once (`RunConfig.from_params`), but whoever may edit XCom or write the run's
storage could hand a later task another configuration. Each task that acts on one re-checks it here, where the
policy's environment is; the workers have no such environment and load what this side checked, pinned by its digest
(core/config/pinned.py). Every launch (the operator's, evaluate's) holds its workers' storage URLs to the run's
layout.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from core.config import ConfigError, RunConfig
from core.config.access import AccessPolicy
from core.config.schema import MODEL_NAME
from core.layout import BASE_MODELS, BASELINE_KEY, DATASET_FINGERPRINT, RunLayout, StorageLayout, absolute_root

MODEL_NAME_PATTERN = re.compile(MODEL_NAME)


def checked_config(saved: Mapping[str, Any]) -> RunConfig:
    """A configuration read back from XCom or storage, held to the access policy of this (Airflow) process again:
    a rewritten one reaches no further than the trigger form could. AirflowFailException naming the setting."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return RunConfig.from_saved(saved, policy=AccessPolicy.from_env())
    except ConfigError as error:
        raise AirflowFailException(f"The prepared run's configuration is refused: {error}") from error


# The worker arguments that name storage, and where in the run's own layout each may point.
LAUNCH_URL_FLAGS = ("--config", "--manifest", "--output", "--model", "--baseline-summary")


def check_launch_urls(args: Sequence[str], storage_root: str, key: str) -> None:
    """The storage URLs a worker group is launched with (rendered from XCom, or derived by the evaluate task) lie in
    this run's own layout under its policy-checked `storage_root` (core/layout.py): `--config` the run's
    config.json or baseline_config.json, `--manifest` a dataset's manifest.json, `--output` a path under the run's
    directory or a baseline's directory or cached evaluation, `--model` the model of the run's training output, of a
    baseline or of a registered version, `--baseline-summary` a baseline's summary.json; fingerprints, baseline keys,
    model names and version numbers of their patterns only. ConfigError naming the argument, the URL and the places
    allowed: an edited XCom launches nothing elsewhere."""
    layout = StorageLayout(absolute_root(storage_root))
    run = layout.run(key)
    for flag, url in itertools.pairwise(str(arg) for arg in args):
        if flag in LAUNCH_URL_FLAGS and not _in_layout(flag, url, layout, run):
            baseline = layout.baseline("<baseline_key>")
            where = {"--config": f"{run.config} or {run.baseline_config}",
                     "--manifest": layout.manifest("<fingerprint>"),
                     "--output": f"a path under {run.url}, {baseline.url} or {baseline.evaluation}",
                     "--model": f"{run.train.model}, {baseline.model} or {layout.models}/<model_name>/v<N>/model",
                     "--baseline-summary": baseline.summary}[flag]
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
    if flag == "--output" and url.startswith(run.url + "/"):
        return True
    name = url.removeprefix(layout.baselines + "/").partition("/")[0]
    baseline = layout.baseline(name)
    if url.startswith(layout.baselines + "/") and BASELINE_KEY.fullmatch(name):
        return url in {"--output": (baseline.url, baseline.evaluation), "--model": (baseline.model,),
                       "--baseline-summary": (baseline.summary,)}.get(flag, ())
    if flag == "--model":
        return url == run.train.model or _is_version_model(url, layout)
    return False


def _is_version_model(url: str, layout: StorageLayout) -> bool:
    """`models/<model_name>/v<N>/model`: a registered version's model (the cached base models' folder is no name)."""
    name, _, rest = url.removeprefix(layout.models + "/").partition("/")
    number = rest.removesuffix("/model").removeprefix("v")
    if not (url.startswith(layout.models + "/") and MODEL_NAME_PATTERN.fullmatch(name) and name != BASE_MODELS):
        return False
    return number.isdigit() and url == layout.model(name).version(int(number)).model
