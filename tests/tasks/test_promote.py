"""The promote task on storage laid out as the pipeline leaves it: versions, the latest pointer, the rule, races
and kills, on local disk and on the S3 server alike.

Reports come from the real evaluate task with `fixture_evaluate` standing in for `trainer.evaluate` (see
test_evaluate.py), so the promoted version is really scored on the later run's shards by a child process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tf_multiworker.backends import make_backend

from core.layout import StorageLayout, TrainOutput
from core.storage import copy_tree, exists, filesystem, join, read_bytes, read_json, remove_tree, write_json_atomic
from tasks import evaluate, registry
from tasks.exports import ForeignModelError
from tasks.prepared_run import PreparedRun
from tasks.promote import NoReportError, promote_run
from tasks.report.document import RunReport
from tasks.report.parts import read_parts, run_view
from tests.tasks import run_fixtures

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "storage")
    return request.getfixturevalue("s3_bucket") + "/gpt"


def evaluated_run(root: str, run_id: str, eval_loss: float, spread: float = 0.0, exports: dict | None = None,
                  **settings) -> PreparedRun:
    """A run trained (fixture outputs) and evaluated by the real evaluate task; gate failures are left in the report.
    `spread`: its sequences' losses lie that far on either side of `eval_loss`; `exports`: format -> parity passed
    (default: every format passed)."""
    prepared = run_fixtures.prepare_run(root, run_id, baseline="skip", **settings)
    run_fixtures.write_training_output(prepared.train_url, num_workers=2, train_time_s=30.0, eval_loss=eval_loss,
                                       exports=exports)
    if spread:
        write_json_atomic(join(prepared.train_url, "model", "fixture_eval.json"),
                          {"eval_loss": eval_loss, "spread": spread})
    try:
        evaluate.evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)
    except evaluate.GateFailure:
        pass
    return prepared


def reported_run(source: PreparedRun, run_id: str, eval_loss: float) -> PreparedRun:
    """Another run whose report is `source`'s with its own id, loss and model (a copy of `source`'s training output):
    for the race and kill tests, which are about the registry, without an evaluation per run."""
    prepared = run_fixtures.prepare_run(source.config["storage_root"], run_id, baseline="skip")
    copy_tree(source.train_url, prepared.train_url)
    report = {**read_json(join(source.report_url, "report.json")), "run_id": run_id, "run_key": prepared.run_key}
    report["runs"] = {**report["runs"], "distributed": {**report["runs"]["distributed"], "eval_loss": eval_loss,
                                                        "model_url": TrainOutput(prepared.train_url).model}}
    write_json_atomic(join(prepared.report_url, "report.json"), report)
    return prepared


def promote_own(prepared: PreparedRun) -> dict:
    """The promote task of the DAG run `prepared` was laid out for: its XCom."""
    return promote_run(prepared, run_fixtures.own_run(prepared)).to_xcom()


def models(root: str):
    return StorageLayout(root).model("gpt_finetune")


def report_of(prepared: PreparedRun) -> dict:
    """The run's report as its page shows it: evaluate's report.json with promote's promotion.json beside it."""
    url = join(prepared.report_url, "report.json")
    return run_view(RunReport.from_json(read_json(url), url), *read_parts(prepared.report_url)).to_json()


def test_nightly_runs_promote_only_when_not_worse(root, evaluations):
    first = evaluated_run(root, "scheduled__1", 5.30)
    promoted = promote_run(first, run_fixtures.own_run(first)).to_xcom()
    assert promoted["promoted"] is True and promoted["version"] == "v1"
    assert "first version of 'gpt_finetune'" in promoted["reason"]
    layout = models(root)
    v1 = layout.version(1)
    record = registry.complete_version(v1)
    assert record is not None and {"model/fixture_eval.json", "model/tokenizer.json", "report.json",
                                    "model_card.md"} <= {file.name for file in record.files}
    card = read_bytes(v1.model_card).decode()
    for fragment in ("# gpt_finetune v1", run_fixtures.FINGERPRINT, "Eval loss on the validation split: 5.3000",
                     "eval_loss_finite: pass", '  "learning_rate": 0.003,\n', "tensorflow: 2.21.0",
                     f"Run report: {join(first.report_url, 'report.json')} (the run's release task writes report.md"):
        assert fragment in card
    assert read_json(v1.report)["run_id"] == "scheduled__1"
    assert promoted["event"] == {"model_name": "gpt_finetune", "version": "v1", "url": v1.url,
                                 "model_url": v1.model, "run_id": "scheduled__1", "eval_loss": 5.30,
                                 "perplexity": pytest.approx(200.34, abs=0.01),
                                 "dataset_fingerprint": run_fixtures.FINGERPRINT}

    worse = evaluated_run(root, "scheduled__2", 5.50)
    assert join(v1.model) in evaluations()  # evaluate scored v1 on this run's shards
    assert report_of(worse)["promoted"]["eval_loss"] == 5.30
    refused = promote_run(worse, run_fixtures.own_run(worse)).to_xcom()
    assert refused["promoted"] is False and refused["version"] is None and refused["event"] is None
    assert "worse than the promoted version by more than 'promotion_tolerance'" in refused["reason"]
    assert "eval loss 5.5000 vs 5.3000 of promoted v1" in refused["reason"]
    assert "both scored on this run's evaluation sample" in refused["reason"]
    assert not exists(join(worse.report_url, "report.md"))  # promote writes promotion.json alone; release report.md
    markdown = run_fixtures.released_markdown(worse.report_url)
    assert "**Not promoted** (policy 'auto'): worse than the promoted version" in markdown
    samples = markdown.split("## Samples")[1]
    assert "**Prompt 1:** To be, or not" in samples
    assert "| distributed |  to be, that is |" not in samples  # cells are trimmed, one line each
    assert "| distributed | to be, that is | the question of a fixture |" in samples
    assert "| promoted v1 | to be, that is | the question of a fixture |" in samples
    assert report_of(worse)["promotion"]["promoted"] is False

    better = evaluated_run(root, "scheduled__3", 5.20)
    assert promote_run(better, run_fixtures.own_run(better)).to_xcom()["version"] == "v2"
    pointer = registry.read_latest(layout)
    assert (pointer.version, pointer.run_id) == ("v2", "scheduled__3")
    assert [(entry.version, entry.run_id, entry.eval_loss) for entry in pointer.history] == [
        ("v1", "scheduled__1", 5.30), ("v2", "scheduled__3", 5.20)]
    assert "**Promoted** to gpt_finetune v2" in run_fixtures.released_markdown(better.report_url)


def test_tolerance_and_the_promote_policies(evaluations, tmp_path):
    root = str(tmp_path / "storage")
    promote_own(evaluated_run(root, "r1", 5.30))
    assert promote_own(evaluated_run(root, "r2", 5.35, promotion_tolerance=0.1))["version"] == "v2"
    assert promote_own(evaluated_run(root, "r3", 9.0, promote="always"))["version"] == "v3"
    never = promote_own(evaluated_run(root, "r4", 1.0, promote="never"))
    assert never["promoted"] is False and never["reason"] == "setting 'promote' = 'never'."
    failed_gate = promote_own(evaluated_run(root, "r5", float("nan"), promote="always"))
    assert failed_gate["promoted"] is False and "the run's gates failed (distributed eval loss is nan" in \
        failed_gate["reason"]
    assert [entry.run_id for entry in registry.read_latest(models(root)).history] == ["r1", "r2", "r3"]


def test_a_version_scored_on_other_data_is_compared_by_its_record_and_the_reason_says_so(evaluations, tmp_path):
    root = str(tmp_path / "storage")
    promote_own(evaluated_run(root, "r1", 5.30))
    other = "0e0000000000000000da"
    other_data = run_fixtures.write_manifest(root, fingerprint=other, tokenizer_fingerprint="tok-other")
    tokenizer = join(StorageLayout(root).dataset(other), "tokenizer", "tokenizer.json")
    Path(tokenizer).write_text(json.dumps({**run_fixtures.TOKENIZER_JSON, "model": {"type": "BPE", "vocab": {}}}))
    later = evaluated_run(root, "r2", 5.10, manifest_url=other_data)
    assert report_of(later)["promoted"]["eval_loss"] is None  # another tokenizer: not scorable on these shards
    outcome = promote_run(later, run_fixtures.own_run(later)).to_xcom()
    assert outcome["promoted"] is True
    assert ("its recorded eval loss, NOT on the same validation shards: it was scored on dataset "
            f"{run_fixtures.FINGERPRINT}, this run on {other}") in outcome["reason"]
    assert "tokenizer differs from this run's" in outcome["reason"]


def test_a_sampled_comparison_allows_two_paired_standard_errors_and_records_its_sample(evaluations, tmp_path):
    """8 of the split's 40 sequences: v1 is scored again on the run's sample beside it, and the rule allows the
    delta two standard errors of the paired per-sequence differences beyond 'promotion_tolerance'."""
    root = str(tmp_path / "storage")
    first = evaluated_run(root, "r1", 5.30, spread=0.20, eval_tokens=512)
    assert promote_run(first, run_fixtures.own_run(first)).to_xcom()["version"] == "v1"
    entry = registry.read_latest(models(root)).history[0]
    sample = report_of(first)["eval_sample"]
    assert entry.eval_sample == sample["id"] and entry.eval_loss_se > 0 and sample["tokens"] == 512

    later = evaluated_run(root, "r2", 5.32, spread=0.25, eval_tokens=512)  # worse by 0.02: within the error
    promoted = report_of(later)["promoted"]
    delta_se = 0.05 * (8 / 7 / 8) ** 0.5 * ((40 - 8) / (40 - 1)) ** 0.5  # differences 0.02 -+ 0.05, paired
    assert promoted["eval_sample"] == sample["id"] and promoted["delta_se"] == pytest.approx(delta_se)
    outcome = promote_run(later, run_fixtures.own_run(later)).to_xcom()
    assert outcome["promoted"] is True and outcome["version"] == "v2"
    assert (f"+0.0200 nats, limit {2 * delta_se:.4f} = tolerance 0.0000 + 2 x {delta_se:.4f}, the standard error "
            "of the delta (paired over the sample's sequences)") in outcome["reason"]
    assert f"both scored on this run's evaluation sample {sample['id']}" in outcome["reason"]
    worse = promote_own(evaluated_run(root, "r3", 5.40, spread=0.25, eval_tokens=512))  # 0.08: beyond it
    assert worse["promoted"] is False and "worse than the promoted version" in worse["reason"]


def test_a_retried_promotion_keeps_the_version_it_got(evaluations, tmp_path):
    prepared = evaluated_run(str(tmp_path / "storage"), "r1", 5.30)
    first = promote_run(prepared, run_fixtures.own_run(prepared)).to_xcom()
    again = promote_run(prepared, run_fixtures.own_run(prepared)).to_xcom()  # the task retried after its pointer swap
    assert (again["promoted"], again["version"], again["event"]) == (True, "v1", first["event"])
    assert "already promoted to v1 by an earlier attempt" in again["reason"]
    assert len(registry.read_latest(models(prepared.config["storage_root"])).history) == 1


def test_a_run_without_a_report_is_not_promoted(tmp_path):
    prepared = run_fixtures.prepare_run(str(tmp_path / "storage"), "r1")
    with pytest.raises(NoReportError, match="evaluate failed before writing it"):
        promote_run(prepared, run_fixtures.own_run(prepared))
    assert not exists(models(prepared.config["storage_root"]).url)


def test_a_version_holds_each_format_in_its_folder_and_the_card_lists_them(evaluations, tmp_path):
    root = str(tmp_path / "storage")
    prepared = evaluated_run(root, "r1", 5.30)
    assert promote_run(prepared, run_fixtures.own_run(prepared)).to_xcom()["version"] == "v1"
    v1 = models(root).version(1)
    names = {file.name for file in registry.complete_version(v1).files}
    assert {"model/tokenizer.json", "model/model.safetensors", "saved_model/saved_model.pb"} <= names
    assert not any(name.startswith("safetensors/") for name in names)  # the model directory is that format
    assert read_bytes(join(v1.model, "model.safetensors")) == b"fixture safetensors"
    # One writer per file: report.json is evaluate's; the export gates are in promote's promotion.json.
    assert not [gate for gate in read_json(join(prepared.report_url, "report.json"))["gates"]
                if gate["name"].startswith("export_")]
    assert read_json(join(prepared.report_url, "promotion.json"))["version"] == "v1"
    gates = {gate["name"]: gate for gate in report_of(prepared)["gates"]}
    assert {name: (gate["passed"], gate["value"], gate["limit"]) for name, gate in gates.items()
            if name.startswith("export_")} == {f"export_{name}": (True, 2.5e-7, 1e-4)
                                                for name in ("safetensors", "saved_model")}
    card = read_bytes(v1.model_card).decode()
    for fragment in ("## Formats", "on 3 prompts of 32 tokens from the validation split",
                     "### `model/`: the model: config.json + model.safetensors for transformers 5 with PyTorch",
                     "### `saved_model/`: TensorFlow SavedModel",
                     "- Parity: pass: max |logit diff| 2.50e-07 (limit 1e-04), greedy tokens 96/96 same",
                     "- Files: `model.safetensors`",
                     'model = AutoModelForCausalLM.from_pretrained("model")',
                     'logits = load_pretrained("model")(ids)',
                     'serve = tf.saved_model.load("saved_model").signatures["serving_default"]',
                     "- export_safetensors: pass (export safetensors: max |logit diff| 2.50e-07"):
        assert fragment in card, fragment


def test_a_failed_or_missing_export_blocks_promotion_with_a_gate_row_naming_it(evaluations, tmp_path):
    root = str(tmp_path / "storage")
    failed = evaluated_run(root, "r1", 5.30, exports={"safetensors": False, "saved_model": True})
    outcome = promote_run(failed, run_fixtures.own_run(failed)).to_xcom()
    assert outcome["promoted"] is False
    assert ("the run's gates failed (export safetensors: max |logit diff| 3.20e-02 (limit 1e-04), greedy tokens "
            "90/96 same), so it is never promoted") in outcome["reason"]
    report = report_of(failed)
    assert report["gates_passed"] is False
    assert [(gate["name"], gate["passed"]) for gate in report["gates"] if gate["name"].startswith("export_")] == [
        ("export_safetensors", False), ("export_saved_model", True)]
    markdown = run_fixtures.released_markdown(failed.report_url)
    assert "| export_safetensors | **FAIL** | 0.032 | 0.0001 | export safetensors: max" in markdown

    missing = evaluated_run(root, "r2", 5.30)
    remove_tree(TrainOutput(missing.train_url).exports)  # training ended before its exports were published
    outcome = promote_run(missing, run_fixtures.own_run(missing)).to_xcom()
    assert outcome["promoted"] is False
    assert (f"export safetensors: not written ({TrainOutput(missing.train_url).exports_record} is missing"
            in outcome["reason"])
    assert promote_own(missing)["reason"].count("export safetensors") == 1  # a retry replaces the rows
    assert registry.read_latest(models(root)) is None

    model_only = evaluated_run(root, "r3", 5.30, export_formats=[])  # [] keeps model/ alone, unchecked
    assert promote_run(model_only, run_fixtures.own_run(model_only)).to_xcom()["version"] == "v1"
    v1 = models(root).version(1)
    assert {file.name.split("/")[0] for file in registry.complete_version(v1).files} == {
        "model", "report.json", "model_card.md"}
    assert not any(gate["name"].startswith("export_") for gate in report_of(model_only)["gates"])
    card = read_bytes(v1.model_card).decode()
    assert "Only `model/` (config.json, model.safetensors, generation_config.json and the tokenizer)" in card
    assert 'model = AutoModelForCausalLM.from_pretrained("model")' in card


PROMOTER = """
import json, sys, time
from tasks.prepared_run import PreparedRun
from tasks.promote import promote_run
from tests.tasks import run_fixtures
prepared, start_at = PreparedRun.from_xcom(json.loads(sys.argv[1])), float(sys.argv[2])
time.sleep(max(0.0, start_at - time.time()))  # every promoter starts together
print(json.dumps(promote_run(prepared, run_fixtures.own_run(prepared)).to_xcom()))
"""


def promoter(prepared: PreparedRun, start_at: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PROMOTER, json.dumps(prepared.to_xcom()), str(start_at)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def assert_pointer_consistent(layout) -> registry.Pointer:
    """latest names the last history entry; the history's numbers rise; every version in it is complete."""
    pointer = registry.read_latest(layout)
    numbers = [entry.number for entry in pointer.history]
    assert numbers == sorted(set(numbers)), numbers
    assert pointer.version == pointer.history[-1].version
    for entry in pointer.history:
        assert registry.complete_version(layout.version(entry.number)) is not None, entry.version
    return pointer


def test_concurrent_promotions_never_interleave_versions(root, evaluations):
    source = evaluated_run(root, "concurrent__0", 5.30)
    runs = [source] + [reported_run(source, f"concurrent__{index}", 5.30) for index in range(1, 3)]
    start_at = time.time() + 4.0
    processes = [promoter(prepared, start_at) for prepared in runs]
    outcomes = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err[-3000:]
        outcomes.append(json.loads(out.splitlines()[-1]))

    # Equal losses are never worse: all three are promoted, each to its own version, one after another.
    assert all(outcome["promoted"] for outcome in outcomes)
    pointer = assert_pointer_consistent(models(root))
    assert sorted(entry.run_id for entry in pointer.history) == sorted(run.run_id for run in runs)
    assert sorted(outcome["version"] for outcome in outcomes) == sorted(e.version for e in pointer.history)


def test_a_promotion_killed_on_s3_leaves_latest_on_a_complete_version(s3_faults, s3_faulty_bucket, evaluations):
    root = s3_faulty_bucket + "/gpt"
    layout = models(root)
    first = evaluated_run(root, "r1", 5.30)
    promote_run(first, run_fixtures.own_run(first))
    killed = reported_run(first, "r2", 5.20)
    # The promotion's PUTs: its claim, two model files, two export files, then report.json: hold that one and kill
    # the promoter.
    s3_faults.hold_at(s3_faults.object_puts + 6)
    process = promoter(killed, 0)
    assert s3_faults.held.wait(60), "the promotion never reached its report.json"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    s3_faults.heal()

    pointer = assert_pointer_consistent(layout)
    assert [entry.version for entry in pointer.history] == ["v1"]
    assert registry.complete_version(layout.version(2)) is None  # claimed, half-written, pointed to by nothing
    assert promote_own(reported_run(first, "r3", 5.10))["version"] == "v3"
    assert [entry.version for entry in assert_pointer_consistent(layout).history] == ["v1", "v3"]


def test_a_promotion_killed_on_local_disk_leaves_latest_on_a_complete_version(tmp_path, evaluations):
    root = str(tmp_path / "storage")
    layout = models(root)
    promote_own(evaluated_run(root, "r1", 5.30))
    killed = evaluated_run(root, "r2", 5.20)
    # A model file large enough that its copy is still running when the promoter is killed.
    with open(join(killed.train_url, "model", "model.safetensors"), "wb") as handle:
        handle.truncate(256 << 20)
    process = promoter(killed, 0)
    copied = Path(layout.version(2).model)
    deadline = time.monotonic() + 60
    while not copied.exists():
        assert time.monotonic() < deadline and process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)

    assert registry.complete_version(layout.version(2)) is None, "killed after the version was complete"
    pointer = assert_pointer_consistent(layout)
    assert [entry.version for entry in pointer.history] == ["v1"]
    os.remove(join(killed.train_url, "model", "model.safetensors"))
    assert promote_own(evaluated_run(root, "r3", 5.10))["version"] == "v3"


def pointer_to(layout, number: int) -> registry.Pointer:
    version = layout.version(number)
    entry = registry.Entry(version=f"v{number}", number=number, url=version.url,
                           model_url=version.model, run_id=f"r{number}", run_key=f"k{number}",
                           promoted_at="2026-12-05T00:00:00.000+00:00", eval_loss=5.0, perplexity=148.4,
                           dataset_fingerprint="f", run_report_url=f"runs/k{number}/report/report.json")
    return registry.Pointer.moved_to(entry, "m", None)


def test_pointer_swaps_and_claims_are_exclusive(root):
    layout = models(root)
    assert registry.read_pointer(layout) == (None, None)
    assert registry.swap_pointer(layout.latest, None, pointer_to(layout, 1)) is True
    assert registry.swap_pointer(layout.latest, None, pointer_to(layout, 9)) is False
    pointer, token = registry.read_pointer(layout)
    assert pointer == pointer_to(layout, 1)
    assert registry.swap_pointer(layout.latest, token, pointer_to(layout, 2)) is True
    assert registry.swap_pointer(layout.latest, token, pointer_to(layout, 3)) is False  # stale token
    assert registry.read_latest(layout).version == "v2"
    assert [registry.claim_version(layout, 0, "r1") for _ in range(3)] == [1, 2, 3]
    assert registry.claim_version(layout, 7, "r1") == 8
    fs, path = filesystem(layout.claim(2))
    assert json.loads(fs.cat_file(path))["version"] == "v2"


def promoted_legacy_version(root: str):
    """v1 promoted from a model/ as transformers 4.57 saved it (tf_model.h5, no model.safetensors)."""
    import shutil

    prepared = evaluated_run(root, "r1", 5.30, export_formats=[])
    model = Path(prepared.train_url) / "model"
    (model / "model.safetensors").unlink()
    for name in ("tf_model.h5", "config.json", "generation_config.json"):  # the run's tokenizer stays
        shutil.copy2(Path(__file__).parent / "fixtures" / "legacy_tf_model" / name, model / name)
    assert promote_own(prepared)["version"] == "v1"
    v1 = models(root).version(1)
    assert not exists(join(v1.model, "model.safetensors"))
    return v1


def test_a_version_promoted_with_tf_model_h5_only_is_converted_once_when_a_run_continues_from_it(evaluations,
                                                                                                 tmp_path):
    """A version promoted before the model became a safetensors checkpoint: continuing from it converts its h5 once
    (tasks/legacy_models.py) and leaves it complete (nothing version.json lists changes)."""
    from core.config import RunConfig
    from tasks.promote import resolve_promoted_model

    root = str(tmp_path / "storage")
    v1 = promoted_legacy_version(root)

    cfg = RunConfig.from_params({"storage_root": root, "model": "promoted", "block_size": 16})
    resolved, version = resolve_promoted_model(cfg)
    assert resolved.model == v1.model and version.version == "v1"
    assert exists(join(v1.model, "model.safetensors")) and registry.complete_version(v1) is not None
    converted = read_bytes(join(v1.model, "model.safetensors"))
    resolve_promoted_model(cfg)  # once: the second run reads what the first converted
    assert read_bytes(join(v1.model, "model.safetensors")) == converted


def test_a_version_promoted_with_tf_model_h5_only_is_converted_before_a_later_run_scores_it(evaluations, tmp_path):
    root = str(tmp_path / "storage")
    v1 = promoted_legacy_version(root)
    later = evaluated_run(root, "r2", 5.20)
    assert exists(join(v1.model, "model.safetensors")) and registry.complete_version(v1) is not None
    assert v1.model in evaluations()  # scored on the later run's sample, as its converted checkpoint
    assert report_of(later)["promoted"]["eval_loss"] is not None


# -- a storage writer copies nothing into the registry (issue 48 item 2, review t5 finding 2) -------------------

def secret_folder(tmp_path: Path) -> Path:
    """A folder the Airflow worker can read and storage readers must never see."""
    secret = tmp_path / "home" / ".ssh"
    secret.mkdir(parents=True)
    (secret / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    return secret


def assert_nothing_promoted(root: str) -> None:
    assert registry.read_latest(models(root)) is None
    assert not exists(models(root).version(1).url), "files were copied into the registry"


def test_a_report_naming_another_model_folder_promotes_nothing(evaluations, tmp_path):
    """The review's case (a): `export_formats: []` and report.json's model_url rewritten to a secret folder."""
    root = str(tmp_path / "storage")
    prepared = evaluated_run(root, "r1", 5.30, export_formats=[])
    secret = secret_folder(tmp_path)
    url = join(prepared.report_url, "report.json")
    report = read_json(url)
    report["runs"]["distributed"]["model_url"] = str(secret)
    write_json_atomic(url, report)
    with pytest.raises(ForeignModelError, match=f"runs.distributed.model_url = {str(secret)!r} is not this run's "
                                                f"model \\(it must be {TrainOutput(prepared.train_url).model!r}"):
        promote_own(prepared)
    assert_nothing_promoted(root)


@pytest.mark.parametrize(("name", "folder"), [("saved_model", "../../../../home/.ssh"),
                                              ("safetensors", "exports/safetensors"), ("../../home", "model")])
def test_an_exports_record_naming_another_folder_promotes_nothing(evaluations, tmp_path, name, folder):
    """The review's case (b): the default `export_formats`, only exports.json rewritten."""
    root = str(tmp_path / "storage")
    prepared = evaluated_run(root, "r1", 5.30)
    secret_folder(tmp_path)
    record_url = TrainOutput(prepared.train_url).exports_record
    record = read_json(record_url)
    record["formats"][name] = {**record["formats"].get(name, record["formats"]["safetensors"]), "dir": folder}
    write_json_atomic(record_url, record)
    with pytest.raises(ForeignModelError, match=f"formats.{re.escape(name)}.dir = {re.escape(repr(folder))} is not "
                                                "that format's folder \\(it must be "):
        promote_own(prepared)
    assert_nothing_promoted(root)


def test_continuing_from_a_pointer_outside_its_version_is_refused_by_prepare(evaluations, tmp_path):
    """`model: promoted` trains from latest.json's model_url: one that leaves its version's folder is refused."""
    from core.config import ConfigError, RunConfig
    from tasks.promote import resolve_promoted_model

    root = str(tmp_path / "storage")
    promote_own(evaluated_run(root, "r1", 5.30))
    secret = secret_folder(tmp_path)
    pointer = read_json(models(root).latest)
    write_json_atomic(models(root).latest, {**pointer, "model_url": str(secret)})
    with pytest.raises(ConfigError, match=f"Setting 'model' = 'promoted': .*Pointer.model_url = {str(secret)!r} "
                                          f"\\(it must be {models(root).version(1).model!r}\\)"):
        resolve_promoted_model(RunConfig.from_params({"storage_root": root, "model": "promoted"}))


def test_the_model_card_writes_settings_as_fenced_json_and_no_value_ends_its_code_span(tmp_path, evaluations):
    """Review t5, finding 8: a backtick in a setting ended the card's code span and let HTML into model_card.md.
    text_column may no longer hold one (core/config/core.py); the dataset URL and the run id still may."""
    injected = "s3://gpt-finetune/``x` <img src=x onerror=alert(1)> |\n## Security notice/*.txt"
    run_id = "manual__`<a href=\"https://evil.example\">rotate</a>`"
    promoted = promote_own(evaluated_run(str(tmp_path / "storage"), run_id, 5.30, dataset=injected))
    assert promoted["promoted"] is True
    card = read_bytes(models(str(tmp_path / "storage")).version(1).model_card).decode()
    settings = card.split("## Settings\n\n```json\n", 1)[1].split("\n```\n", 1)[0]
    assert json.loads(settings)["dataset"] == injected and json.loads(settings)["learning_rate"] == 0.003
    assert "\n## Security notice" not in card  # the newline is escaped, in the JSON and in the code span
    assert ("(setting `dataset` = ```s3://gpt-finetune/``x` <img src=x onerror=alert(1)> |\\n## Security "
            "notice/*.txt```") in card
    assert "from run `` manual__`<a href=\\\"https://evil.example\\\">rotate</a>` ``" in card
    assert "| text_column |" not in card  # no Markdown table whose cells a value could split
