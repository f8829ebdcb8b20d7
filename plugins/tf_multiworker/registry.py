"""`make_backend`: a backend by name, from the one table in `tf_multiworker.launcher.protocol` (also read by
`RunConfig` for the allowed values and by the DAG's `backend` enum); adding a backend means one line there and its
factory.

Light on purpose (the DAG file and every worker import it): each factory is imported only when used. Factories
live on the Airflow side (`tf_multiworker.backends`), because remote backends resolve Airflow connections; the
backends themselves (`tf_multiworker.launcher.*`) never import Airflow.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tf_multiworker.launcher.protocol import BACKEND_NAMES, BACKENDS

if TYPE_CHECKING:
    from tf_multiworker.launcher.backend import Backend

__all__ = ["BACKENDS", "BACKEND_NAMES", "UnknownBackendError", "make_backend"]

class UnknownBackendError(ValueError):
    pass


def make_backend(name: str, settings: Mapping[str, Any] | None = None) -> Backend:
    """The backend called `name`, configured from the run's settings (a `RunConfig.to_dict()`)."""
    if name not in BACKENDS:
        raise UnknownBackendError(
            f"backend {name!r} is not available: choose one of {', '.join(BACKEND_NAMES)} (setting 'backend')")
    module, _, function = BACKENDS[name][0].partition(":")
    return getattr(importlib.import_module(module), function)(dict(settings or {}))
