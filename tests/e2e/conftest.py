"""`celery_stack`: the production topology (tests/support/celery_stack.py) for a test module."""

import pytest


@pytest.fixture(scope="module")
def celery_stack(tmp_path_factory):
    """A CeleryExecutor stack (tests/support/celery_stack.py) running the repo's DAGs, stopped after the module."""
    from tests.support.celery_stack import start_celery_stack, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    # As for the standalone stack: no scheduled run holding the active-run slot, quick retries, storage in tmp.
    extra_env = {"GPT_FINETUNE_STORAGE_ROOT": str(tmp_path_factory.mktemp("celery_storage")),
                 "GPT_FINETUNE_SCHEDULE": "none", "GPT_FINETUNE_RETRY_DELAY_S": "2"}
    stack = start_celery_stack(tmp_path_factory.mktemp("celery_home"), extra_env)
    try:
        yield stack
    finally:
        stack.stop()
