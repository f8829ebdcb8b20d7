"""What the prepare stage's later tasks read back from XCom and storage, checked before use.

XCom and storage can be written by others than this run's prepare task (anyone with XCom edit rights on the DAG,
anyone holding the storage credentials). So `tokenize` and `publish` take only ids from XCom: the fingerprint
and the plan id name the plan file under the run's own storage root, from a configuration held to the access
policy again; and what the plan file says (its work directory, tokenizer, source URLs, and the lane's units) must
match that layout and that policy before a byte is read or written. Failures are `PrepareError` naming the file or
the setting."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tasks.dataset.errors import PrepareError
from tasks.dataset.publish import work_url
from trainer import storage
from trainer.config import ConfigError, RunConfig
from trainer.config.access import AccessPolicy
from trainer.layout import TOKENIZER_DIR, StorageLayout

PLAN_FILE = "plan.json"
FINGERPRINT = re.compile(r"[0-9a-f]{20}")  # tasks.dataset.publish.dataset_fingerprint
PLAN_ID = re.compile(r"[0-9a-f]{12}")  # plan_dataset's uuid4().hex[:12]


def plan_location(cfg: RunConfig, fingerprint: Any, plan_id: Any) -> str:
    """Where the plan of these ids lies under `cfg`'s storage root; PrepareError for ids of another format."""
    if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
        raise PrepareError(f"The prepared plan's fingerprint {fingerprint!r} is not one (20 hex digits): refusing it.")
    if not isinstance(plan_id, str) or not PLAN_ID.fullmatch(plan_id):
        raise PrepareError(f"The prepared plan's id {plan_id!r} is not one (12 hex digits): refusing it.")
    return storage.join(work_url(StorageLayout(cfg.storage_root), fingerprint), plan_id)


def checked_plan(summary: Mapping[str, Any], cfg: RunConfig, policy: AccessPolicy) -> dict[str, Any]:
    """The whole plan for an XCom summary, read from where its ids say under `cfg`'s storage root, and checked."""
    fingerprint, plan_id = summary.get("fingerprint"), summary.get("plan_id")
    work = plan_location(cfg, fingerprint, plan_id)
    url = storage.join(work, PLAN_FILE)
    try:
        plan = storage.read_json(url)
    except (OSError, ValueError) as error:
        raise PrepareError(f"The plan {url} cannot be read ({type(error).__name__}: {error}): prepare again.") \
            from None
    job = plan.get("job") if isinstance(plan, dict) else None
    if not isinstance(job, dict) or not isinstance(job.get("sources"), list):
        raise PrepareError(f"The plan {url} is not a plan (no job with sources): prepare again.")
    expected = {"fingerprint": fingerprint, "manifest_url": StorageLayout(cfg.storage_root).manifest(fingerprint),
                "temporary_work": False, "job.plan_id": plan_id, "job.work_url": work,
                "job.tokenizer_dir": storage.join(work, TOKENIZER_DIR)}
    wrong = [key for key, value in expected.items()
             if (job.get(key[4:]) if key.startswith("job.") else plan.get(key)) != value]
    if wrong:
        raise PrepareError(f"The plan {url} does not match its place under the storage root ({', '.join(wrong)}): "
                           "it was changed after prepare wrote it; refusing it.")
    for source in job["sources"]:
        check_source(source, url, cfg, policy)
    return plan


def check_source(source: Any, plan_url: str, cfg: RunConfig, policy: AccessPolicy) -> None:
    """A source of the plan: a file the policy lets the setting 'dataset' name (a hub dataset's file: of the hub
    dataset the setting names)."""
    address = source.get("url") if isinstance(source, dict) else None
    if not isinstance(address, str) or not isinstance(source.get("size"), int) or source["size"] < 0:
        raise PrepareError(f"The plan {plan_url} names a source that is not one ({str(source)[:200]!r}).")
    if address.startswith("hf://"):
        ok = address.startswith(f"hf://datasets/{cfg.dataset}@") and ".." not in address.split("/")
        if not ok:
            raise PrepareError(f"The plan {plan_url} names source {address!r}, which is not a file of the hub "
                               f"dataset {cfg.dataset!r} the setting 'dataset' names: refusing to read it.")
        return
    try:
        policy.check("dataset", address, hub_ids=False)
    except ConfigError as error:
        raise PrepareError(f"The plan {plan_url} names source {address!r}, which the access policy does not let "
                           f"this run read ({error}): refusing to read it.") from None


def check_lane(plan: Mapping[str, Any], lane: Sequence[Any]) -> None:
    """Each unit of a lane (the mapped task's XCom) within the plan: a unit index it has, parts of its files."""
    sizes = [source["size"] for source in plan["job"]["sources"]]
    for unit in lane:
        if not isinstance(unit, dict) or not _int_in(unit.get("index"), 0, int(plan.get("units", 0)) - 1) or \
                not isinstance(unit.get("parts"), list):
            raise PrepareError(f"A unit of this tokenize task's lane is not one of the plan's: {str(unit)[:200]!r}.")
        for part in unit["parts"]:
            if not _part_within(part, sizes):
                raise PrepareError(f"Unit {unit['index']} of this tokenize task's lane has a part outside the "
                                   f"plan's files: {str(part)[:200]!r}.")


def _part_within(part: Any, sizes: list[int]) -> bool:
    if not isinstance(part, dict) or set(part) != {"file", "start", "end", "bytes"}:
        return False
    if not _int_in(part["file"], 0, len(sizes) - 1) or not _int_in(part["bytes"], 0, 1 << 62):
        return False
    size = sizes[part["file"]]
    return _int_in(part["start"], 0, size) and _int_in(part["end"], part["start"], size)


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
