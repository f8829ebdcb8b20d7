"""`airflow standalone` with this project's start-up step: the `gpu_slots` pool exists before the scheduler starts.

A task in a pool that does not exist is never scheduled, so the pool is created (or resized from
GPT_FINETUNE_GPU_SLOTS) in the same process, right after standalone has migrated the database. Run by
scripts/standalone.sh (`make airflow`, the tests' Airflow stack).
"""

from __future__ import annotations

import sys

from airflow.cli.commands.standalone_command import StandaloneCommand
from airflow.configuration import write_default_airflow_configuration_if_needed
from tf_multiworker.gpu_admission import GPU_POOL, ensure_gpu_pool


class ProjectStandalone(StandaloneCommand):
    def initialize_database(self):
        super().initialize_database()
        slots, how = ensure_gpu_pool()
        self.print_output("standalone", f"Pool {GPU_POOL}: {slots} slots ({how})")


if __name__ == "__main__":
    # As Airflow's CLI does before every command: the components started next read one airflow.cfg, with one
    # generated JWT secret (each would otherwise write its own, and tasks fail with "Invalid auth token").
    write_default_airflow_configuration_if_needed()
    try:
        ProjectStandalone().run()
    except ValueError as exc:  # a malformed GPT_FINETUNE_GPU_SLOTS
        sys.exit(f"standalone: {exc}")
