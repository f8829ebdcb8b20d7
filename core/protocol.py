"""The launcher's protocol with the workers and with the layers above it: names only, stdlib only.

What a worker of any backend finds and says (`trainer/runtime.py` reads it; docs/CONTRACTS.md, "Launcher <->
worker"), which environment it starts from, the names of its temporary directories, the SSH agent's lines and which
backends exist. Every layer imports these from the bottom floor, so no layer imports another's to learn a name.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Mapping
from typing import Any

# The in-band readiness marker: a line of its own on stdout, so it travels wherever the worker's output does.
READY_MARKER = "TFMW_READY"
# Set on every worker of a pipeline run: the release task finds all of the run's processes by it.
RUN_KEY_ENV = "TFMW_RUN_KEY"
# A run key (core.layout.run_key makes them) names directories (storage, the SSH agent's workdir) and travels in
# the environment and labels: letters, digits, '.', '_' and '-', at most 200, not starting with '.' (so never '.' or
# '..', no '/', no newline). Whatever reads one back from a request, XCom or a URL holds it to this (`fullmatch`).
RUN_KEY_CHARACTERS = "A-Za-z0-9._-"  # a regex character class's body
RUN_KEY_PATTERN = re.compile(rf"(?!\.)[{RUN_KEY_CHARACTERS}]{{1,200}}")
# Set next to it: the worker group's name (the task id), so a task's next attempt finds what an earlier one left.
GROUP_ENV = "TFMW_GROUP"
# Set on every worker of a group that reads a run configuration (`--config`): the sha256 of the exact bytes the
# Airflow side wrote there after checking them (core/config/pinned.py). Anyone who can write the bucket (every
# worker host holds its credentials) could change the file in between; a worker refuses a file of another digest.
# Not a secret, but kept out of argv so that the command line stays what the entry point documents.
CONFIG_SHA256_ENV = "TFMW_CONFIG_SHA256"
MANIFEST_SHA256_ENV = "TFMW_MANIFEST_SHA256"  # the dataset manifest's sha256, pinned like the config (trainer/data.py)
# The launcher's per-task temporary directories start with this; release deletes only such directories.
LAUNCHER_WORKDIR_PREFIX = "tfmw-"

# How a worker's exit status tells the launcher, and the operator above it, what a retry can do (docs/CONTRACTS.md,
# "Launcher <-> worker"). 0: done. EXIT_PEER_LOST: a peer went away during a collective; the group restarts together
# and resumes from the latest checkpoint. EXIT_PERMANENT: a failure that no retry can fix (a refused setting, bad
# data, a diverged loss): the task fails at once, without spending its retries. EXIT_PREEMPTED: the worker got
# SIGTERM with notice (a spot reclaim, a node drain, a pod's deletion, the stop ladder), every rank saved a checkpoint
# at the step they agreed on and exited: the next attempt resumes there. Any other status is an ordinary failure.
EXIT_PEER_LOST = 3
EXIT_PERMANENT = 65
EXIT_PREEMPTED = 75
# The launcher stops the rest of a group with this signal, not SIGTERM, when a rank failed (it died, hung or never
# joined): no preemption checkpoint can complete without that rank, so nothing is worth waiting for. Its default
# action ends the process even while it is blocked in a collective, where a Python handler for SIGTERM would never
# run; the trainer holds it back only while it writes a checkpoint (trainer/runtime.py). SIGTERM stays a preemption
# notice: a spot reclaim, a node drain, a pod's deletion, a task stopped from outside.
ABORT_SIGNAL = signal.SIGUSR1

# The SSH agent's lines (launcher/agent.py; docs/CONTRACTS.md, "SSH backend <-> remote agent"). Around a `run`
# worker's output the agent prints control lines, `<tag> <JSON object>`: AGENT_LINE once the worker started, EXIT_LINE
# last. The launcher writes STOP_LINE after the request when it stops the worker itself (then the whole grace applies),
# ABORT_LINE when it stops it because another rank failed.
AGENT_MODULE = "launcher.agent"
AGENT_LINE = "TFMW_AGENT"
EXIT_LINE = "TFMW_EXIT"
STOP_LINE = b"TFMW_STOP\n"
ABORT_LINE = b"TFMW_ABORT\n"  # as STOP_LINE, for a stop after a rank failed: the agent signals ABORT_SIGNAL first


def control_line(tag: str, payload: Mapping[str, Any]) -> bytes:
    return f"{tag} {json.dumps(payload)}\n".encode()


class MalformedControlLine(ValueError):
    """A line that starts with a control tag but whose payload is not a JSON object."""


def read_control_line(line: bytes) -> tuple[str, dict[str, Any]] | None:
    """(tag, payload) of one of the agent's control lines, None for any other line (the worker's own output).
    Raises MalformedControlLine for a tagged line whose payload is not a JSON object: a worker prints what it likes."""
    for tag in (AGENT_LINE, EXIT_LINE):
        prefix = f"{tag} ".encode()
        if line.startswith(prefix):
            try:
                payload = json.loads(line[len(prefix):])
            except ValueError as error:  # also a payload that is not UTF-8
                raise MalformedControlLine(f"{tag} line whose payload is not JSON: {error}") from None
            if not isinstance(payload, dict):
                raise MalformedControlLine(f"{tag} line whose payload is a {type(payload).__name__}, not an object")
            _check_control_payload(tag, payload)
            return tag, payload
    return None


def _check_control_payload(tag: str, payload: dict[str, Any]) -> None:
    """The agent line's ids are integers (stop and release signal that pid and process group), its versions an
    object; the exit line's error is text."""
    if tag == EXIT_LINE:
        if not isinstance(payload.get("error") or "", str):
            raise MalformedControlLine(f"{tag} line whose error is {payload['error']!r}, not text")
        return
    for key in ("pid", "pgid"):
        value = payload.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 1):
            raise MalformedControlLine(f"{tag} line whose {key} is {value!r}, not a process id")
    if not isinstance(payload.get("versions") or {}, dict):
        raise MalformedControlLine(f"{tag} line whose versions are {payload['versions']!r}, not an object")


# The host's temporary directory, for what should outlive one worker (the shard cache); see
# launcher.tf_env.worker_temp_environment.
HOST_TMPDIR_ENV = "TFMW_HOST_TMPDIR"


# What a worker inherits from the process that launches it (an Airflow task holds its database URL, Fernet key,
# JWT secret and other connections in its environment: none of that may reach a worker). AWS_* are the storage
# credentials when the run names no connection. The pipeline's own switches (verbose logs, live metrics) travel in
# the group's environment, and its access policy stays with the prepare task (workers load a checked config).
INHERITED_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "http_proxy", "https_proxy", "no_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
})
INHERITED_PREFIXES = ("LC_", "PYTHON", "TF_", "CUDA_", "NCCL_", "NVIDIA_", "XLA_", "HF_", "TRANSFORMERS_",
                      "TOKENIZERS_", "OMP_", "MKL_", "OPENBLAS_", "AWS_", "TFMW_")


def inherited_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of `environ` that a worker (or evaluation) process starts with."""
    return {name: value for name, value in environ.items()
            if name in INHERITED_NAMES or name.startswith(INHERITED_PREFIXES)}


def is_ready_marker(line: str) -> bool:
    return line.startswith(READY_MARKER + " rank=")


# name -> what it means for users. Each backend's factory is Airflow glue (`tf_multiworker/backends.py` resolves
# the connections a backend needs); RunConfig and the DAG's `backend` enum read the names from here.
BACKENDS: dict[str, str] = {
    "local": "processes on the Airflow worker",
    "ssh": "processes on the hosts of ssh_conn_ids, over SSH",
    "kubernetes": "one pod per worker on a Kubernetes cluster",
}
BACKEND_NAMES: tuple[str, ...] = tuple(BACKENDS)
