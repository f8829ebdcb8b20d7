"""Imported at start-up by every test worker (this folder is on its PYTHONPATH: tests/launcher/conftest.py's
`entrypoint_env`). With TFMW_TEST_SHARED_DISK=1, set by tests/plugins/test_operator_kubernetes.py's `pod_case`, the
fake Kubernetes cluster's pods, which share this machine's disk, accept a local storage root in the configuration
they load, as the harness accepts it in the Airflow process (tests/plugins/harness_dags/tfmw_harness.py)."""

import os

if os.environ.get("TFMW_TEST_SHARED_DISK") == "1":
    import core.config.launch as launch_rules

    launch_rules._check_shared_storage = lambda *args: None
