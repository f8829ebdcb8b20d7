"""What the prepare stage's later tasks read back from XCom and storage, checked before use.

XCom and storage can be written by others than this run's prepare task (anyone with XCom edit rights on the DAG,
anyone holding the storage credentials). So `tokenize` and `publish` take only ids from XCom: the fingerprint
and the plan id name the plan file under the run's own storage root, from a configuration held to the access
policy again; and what the plan file says (its work directory, tokenizer, source URLs, and the lane's units) must
match that layout and that policy before a byte is read or written. Failures are `PrepareError` naming the file or
the setting."""

from __future__ import annotations

import re
from typing import Any

from core import storage
from core.config import ConfigError, RunConfig
from core.config.access import AccessPolicy
from core.document import DocumentError
from core.layout import TOKENIZER_DIR, StorageLayout
from tasks.dataset.errors import PrepareError
from tasks.dataset.plan import DatasetPlan
from tasks.dataset.publish import work_url
from tasks.dataset.records import Part, Unit, WorkPlan
from tasks.dataset.sources import SourceFile

PLAN_FILE = "plan.json"
FINGERPRINT = re.compile(r"[0-9a-f]{20}")  # tasks.dataset.publish.dataset_fingerprint
PLAN_ID = re.compile(r"[0-9a-f]{12}")  # plan_dataset's uuid4().hex[:12]


def plan_location(cfg: RunConfig, fingerprint: str, plan_id: str | None) -> str:
    """Where the plan of these ids lies under `cfg`'s storage root; PrepareError for ids of another format."""
    if not FINGERPRINT.fullmatch(fingerprint):
        raise PrepareError(f"The prepared plan's fingerprint {fingerprint!r} is not one (20 hex digits): refusing it.")
    if plan_id is None or not PLAN_ID.fullmatch(plan_id):
        raise PrepareError(f"The prepared plan's id {plan_id!r} is not one (12 hex digits): refusing it.")
    return storage.join(work_url(StorageLayout(cfg.storage_root), fingerprint), plan_id)


def checked_plan(plan: DatasetPlan, cfg: RunConfig, policy: AccessPolicy) -> WorkPlan:
    """The whole plan for the dataset plan's ids, read from where they say under `cfg`'s storage root, and checked:
    a `WorkPlan` (a field of another type refused by name) in its place, its sources held to the policy."""
    work = plan_location(cfg, plan.fingerprint, plan.plan_id)
    url = storage.join(work, PLAN_FILE)
    try:
        written = storage.read_json(url)
    except (OSError, ValueError) as error:
        raise PrepareError(f"The plan {url} cannot be read ({type(error).__name__}: {error}): prepare again.") \
            from None
    try:
        whole = WorkPlan.from_xcom(written)
    except DocumentError as error:
        raise PrepareError(f"The plan {url} is refused: {error} Prepare again.") from None
    job = whole.job
    expected = {"fingerprint": (whole.fingerprint, plan.fingerprint),
                "manifest_url": (whole.manifest_url, StorageLayout(cfg.storage_root).manifest(plan.fingerprint)),
                "temporary_work": (whole.temporary_work, False), "job.plan_id": (job.plan_id, plan.plan_id),
                "job.work_url": (job.work_url, work),
                "job.tokenizer_dir": (job.tokenizer_dir, storage.join(work, TOKENIZER_DIR))}
    wrong = [key for key, (found, wanted) in expected.items() if found != wanted]
    if wrong:
        raise PrepareError(f"The plan {url} does not match its place under the storage root ({', '.join(wrong)}): "
                           "it was changed after prepare wrote it; refusing it.")
    for source in job.sources:
        check_source(source, url, cfg, policy)
    return whole


def check_source(source: SourceFile, plan_url: str, cfg: RunConfig, policy: AccessPolicy) -> None:
    """A source of the plan: a file the policy lets the setting 'dataset' name (a hub dataset's file: of the hub
    dataset the setting names)."""
    address = source.url
    if source.size < 0:
        raise PrepareError(f"The plan {plan_url} names source {address!r} of {source.size} bytes: refusing it.")
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


def checked_lane(plan: WorkPlan, lane: Any) -> tuple[Unit, ...]:
    """The units of a lane (the mapped task's XCom): `Unit`s (a field of another type refused by name), each a unit
    index the plan has, its parts within the plan's files."""
    if not isinstance(lane, list):
        raise PrepareError(f"This tokenize task's lane is not a list of units: {str(lane)[:200]!r}.")
    sizes = [source.size for source in plan.job.sources]
    units = []
    for entry in lane:
        try:
            unit = Unit.from_xcom(entry)
        except DocumentError as error:
            raise PrepareError(f"A unit of this tokenize task's lane is refused: {error}") from None
        if not 0 <= unit.index < plan.units:
            raise PrepareError(f"Unit {unit.index} of this tokenize task's lane is not one of the plan's "
                               f"{plan.units} units.")
        for part in unit.parts:
            if not _part_within(part, sizes):
                raise PrepareError(f"Unit {unit.index} of this tokenize task's lane has a part outside the "
                                   f"plan's files: {part}.")
        units.append(unit)
    return tuple(units)


def _part_within(part: Part, sizes: list[int]) -> bool:
    if not 0 <= part.file < len(sizes) or not 0 <= part.bytes <= 1 << 62:
        return False
    return 0 <= part.start <= part.end <= sizes[part.file]
