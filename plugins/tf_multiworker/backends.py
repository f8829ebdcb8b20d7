"""Backend factories, Airflow side: turn a run's settings (and the Airflow connections they name) into a ready
launcher backend. Listed in `tf_multiworker.registry`; the backends themselves never import Airflow."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tf_multiworker.launcher.backend import Backend


def local_backend(settings: Mapping[str, Any]) -> Backend:
    from tf_multiworker.launcher.local import LocalBackend

    return LocalBackend()


def kubernetes_backend(settings: Mapping[str, Any]) -> Backend:
    from tf_multiworker.kubernetes_clients import kubernetes_backend as build

    return build(settings)
