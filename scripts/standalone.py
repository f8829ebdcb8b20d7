"""`airflow standalone` with this project's start-up step: the `gpu_slots` pool exists before the scheduler starts.

A task in a pool that does not exist is never scheduled, so the pool is created (or resized from
GPT_FINETUNE_GPU_SLOTS) in the same process, right after standalone has migrated the database. Run by
scripts/standalone.sh (`make airflow`, the tests' Airflow stack).
"""

from __future__ import annotations

import sys

from airflow.cli.commands.standalone_command import StandaloneCommand
from tf_multiworker.gpu_admission import GPU_POOL, ensure_gpu_pool


class ProjectStandalone(StandaloneCommand):
    def initialize_database(self):
        super().initialize_database()
        slots, how = ensure_gpu_pool()
        self.print_output("standalone", f"Pool {GPU_POOL}: {slots} slots ({how})")


if __name__ == "__main__":
    try:
        ProjectStandalone().run()
    except ValueError as exc:  # a malformed GPT_FINETUNE_GPU_SLOTS
        sys.exit(f"standalone: {exc}")
