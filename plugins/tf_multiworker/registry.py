"""The backends: where workers run. One table, read by `RunConfig` (allowed values), the DAG's `backend` enum and
`make_backend`; adding a backend means one line here and its factory.

Light on purpose (the DAG file and every worker import it): each factory is imported only when used. Factories
live on the Airflow side (`tf_multiworker.backends`), because remote backends resolve Airflow connections; the
backends themselves (`tf_multiworker.launcher.*`) never import Airflow.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tf_multiworker.launcher.backend import Backend

# name -> (factory "module:function" taking the run's settings, what it means for users)
BACKENDS: dict[str, tuple[str, str]] = {
    "local": ("tf_multiworker.backends:local_backend", "processes on the Airflow worker"),
    "ssh": ("tf_multiworker.backends:ssh_backend", "processes on the hosts of ssh_conn_ids, over SSH"),
    "kubernetes": ("tf_multiworker.backends:kubernetes_backend", "one pod per worker on a Kubernetes cluster"),
}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)


class UnknownBackendError(ValueError):
    pass


def make_backend(name: str, settings: Mapping[str, Any] | None = None) -> Backend:
    """The backend called `name`, configured from the run's settings (a `RunConfig.to_dict()`)."""
    if name not in BACKENDS:
        raise UnknownBackendError(
            f"backend {name!r} is not available: choose one of {', '.join(BACKEND_NAMES)} (setting 'backend')")
    module, _, function = BACKENDS[name][0].partition(":")
    return getattr(importlib.import_module(module), function)(dict(settings or {}))
