"""Shared test settings: offline hub, legacy Keras in every worker, quiet TF logs."""

import json
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
# Tests keep their data and storage in temporary directories: allow those besides the defaults
# (core/config/access.py).
os.environ.setdefault("GPT_FINETUNE_DATA_ROOTS", os.pathsep.join(
    [str(REPO / "data"), str(REPO / "storage"), os.path.realpath(tempfile.gettempdir())]))
# The test deployment's allow-lists (the same module): the connections, SSH hosts, interpreter and recipients that
# tests name besides the defaults. SSH test hosts are tfmw_ssh_host_<n> (tests/support/sshd.py); the stacks' storage
# and alert connections are in tests/e2e/, `no_such_connection` included for prepare to refuse as missing.
TEST_ALLOW_LISTS = {
    "GPT_FINETUNE_STORAGE_CONN_IDS": "run_storage,elastic_run_storage",
    "GPT_FINETUNE_SSH_CONN_IDS": "tfmw_ssh_*,host_*",
    "GPT_FINETUNE_KUBERNETES_CONN_IDS": "k8s_fake",  # the in-repo API server (tests/support/k8s_server.py)
    "GPT_FINETUNE_REMOTE_PYTHONS": "/opt/venv/bin/python",
    "GPT_FINETUNE_ALERT_CONN_IDS": "alerts,alerts_smtp,no_such_connection",
    "GPT_FINETUNE_ALERT_DOMAINS": "example.com,*.example.org",
}
for variable, entries in TEST_ALLOW_LISTS.items():
    os.environ.setdefault(variable, entries)

import pytest

pytest_plugins = ["tests.support.s3server"]  # a real S3-protocol server on loopback, for every test directory

# The test files that take longest, longest first, with their seconds in one `make test` on 2 cores (2026-12-03;
# the suite's junit XML gives them). xdist hands whole files to its workers in collection order
# (`--no-loadscope-reorder` in the Makefile), so these start at once and the many short files fill the gaps at the
# end. In xdist's own order (most tests first) these one- to three-test files came last, and one worker ran an
# end-to-end file alone for minutes while the other sat idle.
LONGEST_FILES = (
    "tests/e2e/test_ssh_pipeline.py",  # 770
    "tests/e2e/test_pipeline.py",  # 480
    "tests/e2e/test_elastic_pipeline.py",  # 373
    "tests/e2e/test_promotion.py",  # 349
    "tests/e2e/test_celery_pipeline.py",  # 322
    "tests/e2e/test_worker_loss.py",  # 305
    "tests/plugins/test_operator_kubernetes.py",  # 277
    "tests/e2e/test_demo.py",  # 262
    "tests/tasks/test_promote.py",  # 208
    "tests/trainer/test_long_runs.py",  # 200
    "tests/plugins/test_elastic.py",  # 180
    "tests/plugins/test_operator.py",  # 177
    "tests/e2e/test_scheduling.py",  # 130
    "tests/trainer/test_evaluate.py",  # 122
    "tests/trainer/test_train.py",  # 110
)


def pytest_collection_modifyitems(items):
    """LONGEST_FILES first, then the other files with the most tests first; a file's tests keep their order."""
    renamed = [path for path in LONGEST_FILES if not (REPO / path).is_file()]
    if renamed:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FILES names files that do not exist: {renamed}")
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)

    def longest_first(path: str) -> tuple:
        if path in LONGEST_FILES:
            return (LONGEST_FILES.index(path), 0)
        return (len(LONGEST_FILES), -len(by_file[path]))

    items[:] = [item for path in sorted(by_file, key=longest_first) for item in by_file[path]]


@pytest.fixture(scope="session")
def monitoring_sinks():
    """The session's StatsD listener and SMTP server (tests/support/metrics_sinks.py), for the stack to report to."""
    from types import SimpleNamespace

    from tests.support.metrics_sinks import SmtpSink, StatsdListener

    sinks = SimpleNamespace(statsd=StatsdListener(), smtp=SmtpSink())
    try:
        yield sinks
    finally:
        sinks.statsd.stop()
        sinks.smtp.stop()


def monitoring_env(sinks) -> dict[str, str]:
    """Airflow's StatsD metrics (InfluxDB-style tags) to the session's listener, and the `alerts_smtp` connection."""
    return {"AIRFLOW__METRICS__STATSD_ON": "True", "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(sinks.statsd.port), "AIRFLOW__METRICS__STATSD_PREFIX": "airflow",
            "AIRFLOW__METRICS__STATSD_INFLUXDB_ENABLED": "True",
            "AIRFLOW_CONN_ALERTS_SMTP": sinks.smtp.connection_uri()}


# The operator's price table of the session's stack (tasks/ledger/pricing.py): CPU workers at 1 EUR per worker-hour.
STACK_PRICES = {"currency": "EUR", "cpu_worker": {"on_demand": 1.0}}


@pytest.fixture(scope="session")
def airflow_stack(tmp_path_factory, monitoring_sinks):
    """One real Airflow standalone for the whole session (start-up costs ~40 s on 2 cores), sending its metrics
    and alerts to `monitoring_sinks` (`stack.sinks`)."""
    from tests.support.airflow_stack import start_stack

    home = tmp_path_factory.mktemp("airflow_home")
    storage = tmp_path_factory.mktemp("stack_storage")
    # No schedule: a scheduled run created at start-up would hold the single active-run slot the tests need.
    stack = start_stack(home, {"GPT_FINETUNE_STORAGE_ROOT": str(storage), "GPT_FINETUNE_RETRY_DELAY_S": "2",
                               "GPT_FINETUNE_SCHEDULE": "none", "GPT_FINETUNE_PRICING": json.dumps(STACK_PRICES),
                               **monitoring_env(monitoring_sinks)})
    stack.sinks = monitoring_sinks
    try:
        # Release reads the GPU tasks' admission waits from the API server through it (tasks/ledger/airflow_api.py)
        stack.rest("POST", "/api/v2/connections", {
            "connection_id": "gpt_finetune_api", "conn_type": "http", "host": "localhost", "port": stack.port,
            "login": stack.login[0], "password": stack.login[1]})
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def host_network():
    """The test hosts' network (tests/support/netns.py): two hosts on network stacks of their own where the
    machine allows (root, iproute2), else None (loopback addresses on this machine's stack). Services the hosts
    must reach (the S3 server) listen on its `gateway`."""
    from tests.support import netns

    reason = netns.unavailable_reason()
    if reason:
        print(f"\ntest hosts on loopback addresses, one network stack: {reason}")
        yield None
        return
    with netns.HostNetwork(2) as network:
        print(f"\ntest hosts on network stacks of their own: {[host.address for host in network.hosts]}")
        yield network


@pytest.fixture(scope="session")
def ssh_hosts(tmp_path_factory, host_network):
    """Two real OpenSSH servers standing in for remote hosts (tests/support/sshd.py), each in its own network namespace
    when the machine allows, else on 127.0.0.2 and 127.0.0.3: each yields its address, port, host key, disk and
    `connection_env()` (the `AIRFLOW_CONN_<ID>` to set)."""
    from tests.support.sshd import start_hosts, stop_hosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    hosts = start_hosts(2, tmp_path_factory.mktemp("ssh_hosts"), host_network)
    try:
        yield hosts
    finally:
        stop_hosts(hosts)
