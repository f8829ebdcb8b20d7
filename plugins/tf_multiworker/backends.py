"""Backend factories, Airflow side: turn a run's `RunConfig` (and the Airflow connections it names) into a ready
launcher backend, and `make_backend`, which picks one by name. The backends themselves (`launcher/`) never import
Airflow; the names and their meanings are `core.protocol.BACKENDS`, and every name there has a factory here.

Light on purpose (the DAG's tasks import it): each backend's modules are imported only when it is built.
"""

from __future__ import annotations

from collections.abc import Callable

from core.config import RunConfig
from core.protocol import BACKEND_NAMES
from launcher.backend import Backend

__all__ = ["UnknownBackendError", "kubernetes_backend", "local_backend", "make_backend", "ssh_backend"]


class UnknownBackendError(ValueError):
    pass


def make_backend(cfg: RunConfig, name: str | None = None) -> Backend:
    """The run's backend (`launch.backend`), or the one called `name` (release ends what every backend of a run
    left), configured from the run's `launch` settings."""
    name = name or cfg.launch.backend
    if name not in FACTORIES:
        raise UnknownBackendError(
            f"backend {name!r} is not available: choose one of {', '.join(BACKEND_NAMES)} (setting 'backend')")
    return FACTORIES[name](cfg)


def local_backend(cfg: RunConfig) -> Backend:
    from launcher.local import LocalBackend

    return LocalBackend()


# A relative remote_workdir lies under each host's own temporary directory ($TMPDIR or /tmp there).
DEFAULT_REMOTE_WORKDIR = "tfmw"


def ssh_backend(cfg: RunConfig) -> Backend:
    """One `RemoteHost` per connection of `ssh_conn_ids`, through the SSH provider's hook (key files, passphrases,
    host-key checking, timeouts come from the connection). Connects lazily: nothing is contacted here."""
    import sys

    from airflow.providers.ssh.hooks.ssh import SSHHook
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    from launcher.errors import LaunchError
    from launcher.ssh import SSHBackend
    from launcher.ssh_agents import RemoteHost

    ssh = cfg.launch.ssh
    hosts = []
    for conn_id in ssh.ssh_conn_ids:
        try:
            conn = BaseHook.get_connection(conn_id)
        except AirflowNotFoundException:
            raise LaunchError(
                f"Setting 'ssh_conn_ids' names {conn_id!r}, which is no Airflow connection: create it (type ssh, "
                f"host, port, login, extra key_file and host_key) with `airflow connections add {conn_id} ...`, or "
                "fix the id.") from None
        if conn.conn_type != "ssh":
            raise LaunchError(f"Setting 'ssh_conn_ids' names {conn_id!r}, a connection of type {conn.conn_type!r}: "
                              "the ssh backend needs connections of type 'ssh'.")
        if not conn.host:
            raise LaunchError(f"SSH connection {conn_id!r} has no host: set its host.")
        # The address peers reach the host at; a separate data network is named by the extra "data_address".
        address = conn.extra_dejson.get("data_address") or conn.host
        # One attempt, a bounded banner wait: an unreachable or silent host fails in seconds (the task retries).
        hook = SSHHook(ssh_conn_id=conn_id, conn_retry_attempts=1, banner_timeout=10)
        hosts.append(RemoteHost(conn_id, address, hook.get_conn))
    return SSHBackend(hosts, remote_python=ssh.remote_python or sys.executable,
                      remote_workdir=ssh.remote_workdir or DEFAULT_REMOTE_WORKDIR,
                      workers_per_host=ssh.workers_per_host)


def kubernetes_backend(cfg: RunConfig) -> Backend:
    from tf_multiworker.kubernetes_clients import kubernetes_backend as build

    return build(cfg)


FACTORIES: dict[str, Callable[[RunConfig], Backend]] = {
    "local": local_backend,
    "ssh": ssh_backend,
    "kubernetes": kubernetes_backend,
}
