"""`make demo`: the whole gpt_finetune DAG end to end on embedded defaults, then where the report is.

Runs `airflow dags test` (every task in this process's Airflow, no scheduler needed) on the project-local home:
the bundled corpus in data/sample/, a BPE tokenizer trained offline, the tiny model, 2 local CPU workers, local
object storage (or, with --s3, a local S3-protocol server). Extra settings: --conf '{"num_workers": 3}'.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
BUCKET = "gpt-finetune"


@contextmanager
def local_s3(address: str) -> Iterator[str]:
    """A moto S3 server on `address` with one bucket; the credentials go to the environment only."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=address, port=0)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({
        "AWS_ACCESS_KEY_ID": "demo", "AWS_SECRET_ACCESS_KEY": "demo-secret", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
    })
    import boto3

    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=BUCKET)
    print(f"Local S3-protocol server at {os.environ['AWS_ENDPOINT_URL']}, bucket s3://{BUCKET}", flush=True)
    try:
        yield f"s3://{BUCKET}/gpt_finetune"
    finally:
        server.stop()


def latest_report(storage_root: str, since: float) -> str | None:
    """The report directory of the newest run under the storage root whose report.json was written after `since`."""
    from core.layout import REPORT_JSON, StorageLayout
    from core.storage import filesystem, join, list_dir

    layout = StorageLayout(storage_root)
    fs, _ = filesystem(layout.runs)
    newest = None
    for key in list_dir(layout.runs):
        report = layout.run(key).report
        _, path = filesystem(join(report, REPORT_JSON))
        if fs.exists(path):
            modified = fs.modified(path).timestamp()
            if modified >= since and (newest is None or modified > newest[0]):
                newest = (modified, report)
    return newest[1] if newest else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--s3", action="store_true", help="store everything on a local S3-protocol server")
    parser.add_argument("--s3-address", default="127.0.0.1",
                        help="where that server listens (default loopback); with backend ssh, an address of this "
                             "machine that the hosts reach")
    parser.add_argument("--conf", default="{}", help="run settings as JSON, as with `airflow dags trigger --conf`")
    args = parser.parse_args()
    conf = json.loads(args.conf)

    with ExitStack() as stack:
        if args.s3:
            conf.setdefault("storage_root", stack.enter_context(local_s3(args.s3_address)))
        conf.setdefault("storage_root", os.environ.get("GPT_FINETUNE_STORAGE_ROOT", str(REPO / "storage")))
        subprocess.run([AIRFLOW, "db", "migrate"], check=True, stdout=subprocess.DEVNULL, cwd=REPO)
        started = time.time()
        print(f"Running gpt_finetune end to end with {json.dumps(conf)}", flush=True)
        result = subprocess.run([AIRFLOW, "dags", "test", "gpt_finetune", "--conf", json.dumps(conf)], cwd=REPO,
                                check=False)  # the report (or its absence) is printed either way
        from core.storage import exists, join, read_bytes

        directory = latest_report(conf["storage_root"], since=started)
        markdown = join(directory, "report.md") if directory and exists(join(directory, "report.md")) else None
        if markdown:
            print("\n" + read_bytes(markdown).decode())
            print(f"Report: {markdown}")
            print("Charts, report.json, promotion.json and release.json beside it; browse all runs with "
                  "`make airflow` -> GPT fine-tune runs.")
        elif directory:  # evaluate wrote report.json; report.md is the release task's, which did not get that far
            print(f"Report: {directory}/report.json; no report.md, which the release task renders last: see its log "
                  "above.")
        else:
            print("No report was written: see the task logs above for the stage that failed.")
        return result.returncode or (0 if markdown else 1)


if __name__ == "__main__":
    sys.exit(main())
