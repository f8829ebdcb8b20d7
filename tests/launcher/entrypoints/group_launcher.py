"""A launcher in a process of its own, so that a test can SIGKILL it as the OOM killer kills an Airflow task runner:

    python group_launcher.py CASE.json

CASE: {"spec": GroupSpec fields, "backend": registry name, "settings": more run settings, "workdir": path}.
Prints `LAUNCHED {"workers": [record, ...]}` once every rank has started, then supervises the group to its end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tf_multiworker.backends import make_backend

from core.config import RunConfig
from launcher import GroupSpec, WorkerGroup


def main(case_file: str) -> int:
    case = json.loads(Path(case_file).read_text())
    # Workers on other hosts need an s3:// root in a run's config; this launcher writes nothing to storage.
    settings = {"storage_root": "s3://unused/root", **case.get("settings", {}), "backend": case["backend"]}
    backend = make_backend(RunConfig.of(**settings))

    def started(workers, attempt) -> None:
        print("LAUNCHED " + json.dumps({"workers": [w.record for w in workers]}), flush=True)

    group = WorkerGroup(GroupSpec(**case["spec"]), backend, case["workdir"], on_line=lambda rank, line: None,
                        on_started=started)
    return 0 if group.run().succeeded else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
