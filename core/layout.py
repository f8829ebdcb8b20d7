"""Where every artifact lives under `storage_root`: one place, so stages never guess each other's paths.

    <root>/datasets/<fingerprint>/manifest.json       written last; readers trust only the manifest
    <root>/datasets/<fingerprint>/tokenizer/          transformers `save_pretrained` format
    <root>/datasets/<fingerprint>/<split>-<i>-of-<n>.tfrecord
    <root>/runs/<run_key>/config.json                 the validated RunConfig
    <root>/runs/<run_key>/baseline_config.json        the same on one worker (grad accumulation x N)
    <root>/runs/<run_key>/state/<task_id>.json        what a worker group launched (for release)
    <root>/runs/<run_key>/logs/<task_id>/rank-<r>.log
    <root>/runs/<run_key>/train/                      the distributed training output (see TrainOutput)
    <root>/runs/<run_key>/train/exports/              serving formats and exports.json (their parity), record last
    <root>/runs/<run_key>/train/segments.json         each launch of train: from step, workers (elastic recovery)
    <root>/runs/<run_key>/report/                     one writer each: report.json and its charts (evaluate),
                                                      promotion.json (promote), release.json, usage.png and
                                                      report.md of all three (release), preflight.json
    <root>/baselines/<baseline_key>/                  a single-worker training output, reusable across runs
    <root>/models/base/<name>@<sha>/                  a hub model at one commit, base_model.json last
    <root>/models/<name>/latest.json                  the promoted version and the history (see tasks/registry.py)
    <root>/models/<name>/v<N>/                        one promoted version: model/, safetensors/, saved_model/,
                                                      report.json, model_card.md
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from core import REPO_ROOT
from core.protocol import RUN_KEY_CHARACTERS
from core.storage import join, normalize_root

# A dataset's names, as prepare writes them. A manifest's fingerprint and shard names become local paths on every
# worker host (the shard cache), so readers accept these forms only: anyone who can write the bucket could
# otherwise place a file anywhere, or make the cache's eviction empty any directory.
DATASET_FINGERPRINT = re.compile(r"[0-9a-f]{20}")  # the first 20 hex digits of a sha256
SPLITS = ("train", "validation")
SHARD_NAME = re.compile(r"(train|validation)-\d{5}-of-\d{5}\.tfrecord")
# A baseline's key as tasks/baseline.py makes it (`<model>-gb<batch>-s<steps>-<16 hex digits>`): the one name under
# `baselines/` a task may act on, whatever XCom or a launch argument says.
BASELINE_KEY = re.compile(r"[A-Za-z0-9-][A-Za-z0-9._-]{0,39}-gb\d+-s\d+-[0-9a-f]{16}")
TOKENIZER_DIR = "tokenizer"
EXPORTS_RECORD = "exports.json"
BASE_MODEL_RECORD = "base_model.json"  # written last in a cached base model (tasks/base_models.py)
ADAPTER_CONFIG = "adapter_config.json"  # a LoRA adapter's base and settings (trainer/adapter_export.py)
BASE_MODELS = "base"  # storage_root/models/base/: cached hub models, a name no registered model may take
# The run's report: three files beside each other, one writer each (tasks/report/parts.py reads them as one).
REPORT_JSON = "report.json"  # evaluate
PROMOTION_JSON = "promotion.json"  # promote: its verdict and the export gates
RELEASE_JSON = "release.json"  # release: the release record and the GPU-time ledger


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


def absolute_root(root: str) -> str:
    """A `storage_root` as every stage uses it: a URL as given, a relative local path from the repository."""
    return normalize_root(root, relative_to=REPO_ROOT)


def local_or_hub(name: str) -> str:
    """A relative local path is taken from the repository root when it does not exist from the cwd."""
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser().resolve())
    if (REPO_ROOT / name).exists():
        return str(REPO_ROOT / name)
    return name


_UNSAFE = re.compile(rf"[^{RUN_KEY_CHARACTERS}]+")
KEY_HASH_CHARS = 10
KEY_TEXT_CHARS = 100


def safe_name(text: str, limit: int) -> str:
    """`text` as a readable name safe in paths and S3 keys, the run key's alphabet: every other run of characters
    becomes '_', then no leading or trailing '.' or '_', at most `limit` characters; "" when nothing is left."""
    return _UNSAFE.sub("_", text).strip("._")[:limit]


def run_key(dag_id: str, run_id: str) -> str:
    """A DAG run as a name safe in paths and S3 keys: the run id made readable, plus a short hash of
    (dag_id, run_id), so that two run ids that sanitize alike, or the same run id in another DAG, never share a
    key, a storage directory or a release sweep: `manual__2026-11-29T15_00_00_00_00-3f1c0a9b2e`. It matches
    `core.protocol.RUN_KEY_PATTERN`, which the SSH agent and the UI hold keys to."""
    if not dag_id or not run_id:
        raise ValueError(f"a run key needs a dag id and a run id, got {dag_id!r} and {run_id!r}")
    digest = hashlib.sha256(f"{dag_id}\0{run_id}".encode()).hexdigest()[:KEY_HASH_CHARS]
    text = safe_name(run_id, KEY_TEXT_CHARS)
    return f"{text}-{digest}" if text else digest


@dataclass(frozen=True)
class TrainOutput:
    """The files one training job (distributed run or baseline) leaves under its directory."""

    url: str

    @property
    def checkpoints(self) -> str:
        return join(self.url, "checkpoints")

    @property
    def model(self) -> str:
        """The final model and tokenizer, `save_pretrained` format, written by the chief only."""
        return join(self.url, "model")

    @property
    def adapter(self) -> str:
        """A LoRA run's adapter in PEFT's layout (trainer/adapter_export.py), written by the chief only."""
        return join(self.url, "adapter")

    @property
    def exports(self) -> str:
        """The serving formats (trainer/export.py), published whole by the chief after `model`: <format>/ folders
        and `exports.json` (each format's files and parity with the trained model), written last."""
        return join(self.url, "exports")

    @property
    def exports_record(self) -> str:
        return join(self.exports, EXPORTS_RECORD)

    @property
    def metrics(self) -> str:
        return join(self.url, "metrics")

    def metrics_file(self, rank: int) -> str:
        """JSON lines: step, loss, learning_rate, tokens_per_s, step_time_s, input_wait_s, ..."""
        return join(self.metrics, f"rank-{rank}.jsonl")

    @property
    def tensorboard(self) -> str:
        return join(self.url, "tensorboard")

    @property
    def summary(self) -> str:
        """summary.json, written by the chief last: its presence means the job completed."""
        return join(self.url, "summary.json")

    @property
    def segments(self) -> str:
        """segments.json: every launch of the train task with its step and worker count (elastic recovery)."""
        return join(self.url, "segments.json")

    @property
    def evaluation(self) -> str:
        """eval.json: a baseline's evaluation, cached beside it by the evaluate task (its key covers the sample)."""
        return join(self.url, "eval.json")


@dataclass(frozen=True)
class StorageLayout:
    root: str

    def dataset(self, fingerprint: str) -> str:
        return join(self.root, "datasets", fingerprint)

    def manifest(self, fingerprint: str) -> str:
        return join(self.dataset(fingerprint), "manifest.json")

    def run(self, key: str) -> RunLayout:
        return RunLayout(join(self.root, "runs", key))

    @property
    def runs(self) -> str:
        return join(self.root, "runs")

    @property
    def baselines(self) -> str:
        return join(self.root, "baselines")

    def baseline(self, baseline_key: str) -> TrainOutput:
        return TrainOutput(join(self.baselines, baseline_key))

    @property
    def models(self) -> str:
        return join(self.root, "models")

    def model(self, name: str) -> ModelLayout:
        return ModelLayout(join(self.models, name))

    def base_model(self, name: str, sha: str) -> str:
        """A hub model's files at one commit, fetched once (tasks/base_models.py): `<name>@<sha>`, '/' as '--'."""
        return join(self.models, BASE_MODELS, f"{name.replace('/', '--')}@{sha}")


@dataclass(frozen=True)
class ModelLayout:
    """One registered model: numbered versions, the claims that hand out their numbers, and the pointer."""

    url: str

    @property
    def latest(self) -> str:
        """latest.json: the current version and the history; written last, by compare-and-swap."""
        return join(self.url, "latest.json")

    def claim(self, number: int) -> str:
        """Created exclusively by the one promotion that gets version number `number`."""
        return join(self.url, "claims", f"v{number}.json")

    @property
    def claims(self) -> str:
        return join(self.url, "claims")

    def version(self, number: int) -> VersionLayout:
        return VersionLayout(join(self.url, f"v{number}"))


@dataclass(frozen=True)
class VersionLayout:
    url: str

    @property
    def model(self) -> str:
        """save_pretrained model and tokenizer, as the trainer's chief wrote them."""
        return join(self.url, "model")

    def export(self, name: str) -> str:
        """The folder of one serving format (trainer/export.py) beside `model/`."""
        return join(self.url, name)

    @property
    def report(self) -> str:
        return join(self.url, "report.json")

    @property
    def model_card(self) -> str:
        return join(self.url, "model_card.md")

    @property
    def record(self) -> str:
        """version.json, written last in the version: every file with its size."""
        return join(self.url, "version.json")


@dataclass(frozen=True)
class PreflightOutput:
    """What the preflight (`trainer.preflight --output <url>`) writes: each rank's checks, then the chief's verdict."""

    url: str

    @property
    def result(self) -> str:
        """preflight.json: the verdict, the collectives and the advisor's table (written by the chief, last)."""
        return join(self.url, "preflight.json")

    def rank_report(self, rank: int) -> str:
        return join(self.url, "preflight", f"rank-{rank}.json")


@dataclass(frozen=True)
class RunLayout:
    url: str

    @property
    def config(self) -> str:
        return join(self.url, "config.json")

    @property
    def baseline_config(self) -> str:
        """The single-worker config this run's baseline trains with (when it is not reused)."""
        return join(self.url, "baseline_config.json")

    @property
    def state(self) -> str:
        return join(self.url, "state")

    def state_file(self, task_id: str) -> str:
        return join(self.state, f"{task_id}.json")

    def logs(self, task_id: str) -> str:
        return join(self.url, "logs", task_id)

    @property
    def train(self) -> TrainOutput:
        return TrainOutput(join(self.url, "train"))

    @property
    def report(self) -> str:
        return join(self.url, "report")

    @property
    def preflight(self) -> PreflightOutput:
        return PreflightOutput(self.report)

    @property
    def report_json(self) -> str:
        return join(self.report, REPORT_JSON)

    @property
    def promotion(self) -> str:
        return join(self.report, PROMOTION_JSON)

    @property
    def release(self) -> str:
        return join(self.report, RELEASE_JSON)
