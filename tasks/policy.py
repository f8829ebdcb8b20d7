"""The access policy, held again on the Airflow side to every configuration a task reads back from XCom or storage.

Prepare checks the trigger's settings once (`RunConfig.from_params`), but whoever may edit XCom or write the run's
storage could hand a later task another configuration. Each task that acts on one re-checks it here, where the
policy's environment is; the workers have no such environment and load what this side checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainer.config import ConfigError, RunConfig
from trainer.config.access import AccessPolicy


def checked_config(saved: Mapping[str, Any]) -> RunConfig:
    """A configuration read back from XCom or storage, held to the access policy of this (Airflow) process again:
    a rewritten one reaches no further than the trigger form could. AirflowFailException naming the setting."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return RunConfig.from_saved(saved, policy=AccessPolicy.from_env())
    except ConfigError as error:
        raise AirflowFailException(f"The prepared run's configuration is refused: {error}") from error
