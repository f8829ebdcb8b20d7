"""What the logs leave out: library chatter no user needs, in one table, applied once per process.

Three kinds, all known harmless and all matched narrowly, so a library's real warnings and everything of ours stay:
- library loggers that narrate routine work at INFO (paramiko's "Connected", botocore's credential discovery):
  raised to WARNING;
- known warnings (log records or Python warnings) of TensorFlow, Airflow's CLI and its libraries:
  dropped by message;
- lines a worker's native code writes to stderr before absl logging starts (CUDA probing on a machine without
  GPUs, the oneDNN and CPU-instruction notices of TensorFlow's import): no environment setting silences those, so
  the launcher leaves them out of the task log. The worker's own log file (`logs/` of the run) keeps every line.

`GPT_FINETUNE_VERBOSE_LOGS=1` in the environment of Airflow turns all of it off; the launcher passes it on to every
worker (`verbose_environment`).
Stdlib only: the Airflow side (airflow_local_settings, the launcher) and every worker entry point apply it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

VERBOSE_ENV = "GPT_FINETUNE_VERBOSE_LOGS"

ROUTINE_LOGGERS = ("paramiko", "botocore", "aiobotocore", "s3fs", "urllib3")

# (logger, message pattern): log records dropped by the logger that creates them (a logger's filters do not see
# its children's records, so each is named exactly).
KNOWN_RECORDS = (
    ("tensorflow", r"Using CollectiveAllReduceStrategy eagerly has significant overhead"),
    # transformers 5 at import, where it serves tokenizers and configs only (the model is trainer/decoders/).
    ("transformers", r"PyTorch was not found\. Models won't be available"),
)

# Python warnings ignored wherever they are raised (each pattern matches the start of the message).
KNOWN_WARNINGS = (
    r"Could not import graphviz",
    r"Using `httpx` with `starlette.testclient` is deprecated",
    r"GitWildMatchPattern \('gitwildmatch'\) is deprecated",
)

# Native lines a worker writes before absl logging is initialised: no log level reaches them. On CPUs where
# TensorFlow's oneDNN kernels or AVX-512 apply, its import announces both (the second line of the CPU notice has no
# prefix of its own); neither changes what a run does.
NATIVE_NOISE = re.compile(
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$"
    r"|^I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine"
    r"|^I\d{4} [\d:. ]+\d+ port\.cc:\d+\] oneDNN custom operations are on\."
    r"|^I\d{4} [\d:. ]+\d+ cpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized to use available CPU "
    r"instructions in performance-critical operations\.$"
    r"|^To enable the following instructions: [A-Z0-9_ ]+, in other operations, rebuild TensorFlow with the "
    r"appropriate compiler flags\.$"
)
# Without GPUs asked for, CUDA's failed probe says nothing either (with them, it is the first clue: kept).
CPU_NATIVE_NOISE = re.compile(r"^E\d{4} [\d:. ]+\d+ cuda_platform\.cc:\d+\] failed call to cuInit")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() in {"1", "true", "yes"}


def verbose_environment() -> dict[str, str]:
    """What a launched worker needs to log as fully as its launcher: a worker starts from an allow-listed
    environment, and one on an SSH host or in a pod from that host's own."""
    return {VERBOSE_ENV: "1"} if verbose() else {}


class _DropKnown(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(str(record.msg))


def quiet_libraries() -> None:
    """Applies the table to this process's loggers and warning filters; idempotent; nothing when verbose."""
    if verbose():
        return
    for name in ROUTINE_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, pattern in KNOWN_RECORDS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and f.pattern.pattern == pattern for f in target.filters):
            target.addFilter(_DropKnown(pattern))
    for pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)


def is_native_noise(line: str, *, use_gpu: bool) -> bool:
    """True for a worker output line that the task log leaves out (never when verbose)."""
    if verbose():
        return False
    return bool(NATIVE_NOISE.search(line)) or (not use_gpu and bool(CPU_NATIVE_NOISE.search(line)))


def configure_worker_logging(level: int = logging.INFO, fmt: str = "%(asctime)s %(levelname)s %(name)s: %(message)s"):
    """A worker entry point's logging: our records at `level` to stderr, the libraries' chatter left out."""
    logging.basicConfig(level=level, stream=sys.stderr, format=fmt)
    quiet_libraries()
