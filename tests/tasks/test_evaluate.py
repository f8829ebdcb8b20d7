"""The evaluate task on storage laid out as the trainer leaves it, evaluating through a real child process.

`fixture_evaluate` stands in for `trainer.evaluate` (same command line and output) so these tests need no TF;
`test_real_evaluate_*` runs the real entry point on a tiny model.
"""

import logging
import math
import os
import shutil
import signal
import time
from importlib import metadata
from pathlib import Path

import airflow  # noqa: F401 (its first import replaces the log handlers: here, not mid-test under caplog)
import pytest
from tf_multiworker.backends import make_backend

from core.config import RunConfig
from core.layout import StorageLayout
from core.storage import exists, join, read_bytes, read_json, write_bytes_atomic, write_json_atomic
from tasks import evaluate
from tasks.baseline import plan_baseline
from tasks.checked_run import Evaluation
from tasks.evaluate import EvaluationError, GateFailure, evaluate_run
from tasks.report.document import RunReport
from tests.tasks import run_fixtures

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "storage")


def trained_run(root, run_id, *, train_time_s=30.0, baseline_time_s=33.0, eval_loss=5.305, baseline_loss=5.300,
                **settings):
    """A run whose prepare, plan_baseline, train and (when planned) baseline tasks have finished."""
    prepared = run_fixtures.prepare_run(root, run_id, **settings)
    cfg = prepared.config
    if plan_baseline(prepared, run_fixtures.own_run(prepared)):
        run_fixtures.write_training_output(prepared.baseline_url, num_workers=1, train_time_s=baseline_time_s,
                                           eval_loss=baseline_loss, global_batch_size=16)
    run_fixtures.write_training_output(prepared.train_url, num_workers=cfg["num_workers"],
                                       train_time_s=train_time_s, eval_loss=eval_loss, global_batch_size=16)
    return prepared


def test_two_workers_against_the_baseline_report_every_figure(root, evaluations, caplog):
    caplog.set_level(logging.INFO, logger="gpt_finetune.evaluate")
    prepared = trained_run(root, "manual__2026-11-29T10:00:00+00:00")
    stale = join(prepared.report_url, "report.md")
    write_bytes_atomic(stale, b"# an earlier attempt's report.md")

    result = evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)

    # report.md is release's alone: evaluate removes an earlier one (it would disagree with report.json) and writes
    # none; its XCom points at report.json.
    assert not exists(stale) and "report_md_url" not in result.to_xcom()

    assert result.speedup == pytest.approx(33.0 / 30.0)
    assert result.efficiency == pytest.approx(33.0 / 30.0 / 2)
    assert (result.eval_loss, result.baseline_eval_loss, result.gates_passed) == (5.305, 5.300, True)
    assert result.report_json_url == join(prepared.report_url, "report.json")
    report = read_json(result.report_json_url)
    distributed, baseline = report["runs"]["distributed"], report["runs"]["baseline"]
    assert (distributed["num_workers"], baseline["num_workers"]) == (2, 1)
    assert distributed["perplexity"] == pytest.approx(math.exp(5.305))
    assert distributed["tokens_per_s"] == pytest.approx(39 * 16 * 64 / 30.0)  # the compiling first step untimed
    assert (distributed["eval_time_s"], distributed["eval_tokens"]) == (1.25, 40 * 63)  # 63 predicted per sequence
    # 1,000,000 tokens asked of a split of 2,560: all of it, on both workers, and the report says so.
    assert report["eval_sample"] == {**distributed["eval_sample"], "workers": 2} == baseline["eval_sample"]
    assert report["eval_sample"]["whole_split"] is True and report["eval_sample"]["tokens"] == 2560
    assert distributed["eval_loss_se"] == 0.0 and report["comparison"]["loss_delta_se"] == 0.0
    assert report["comparison"]["loss_delta"] == pytest.approx(0.005)
    assert [gate["name"] for gate in report["gates"]] == ["eval_loss_finite", "same_work", "loss_parity"]
    assert report["hardware"]["line"].startswith("2 workers on a 2-core CPU: efficiency is bounded by cores")
    assert report["config"]["num_workers"] == 2 and report["versions"]["tensorflow"] == "2.21.0"
    assert report["baseline"] == {"policy": "auto", "key": prepared.baseline_key, "url": prepared.baseline_url,
                                  "trained_by_run": prepared.run_id, "reused": False}
    # Read back as its typed document (promote, later runs' history), it writes exactly these keys and values.
    assert RunReport.from_json(report, result.report_json_url).to_json() == report

    markdown = run_fixtures.released_markdown(prepared.report_url)
    assert ("| run | workers | train time | eval time | tokens/s | speedup | efficiency | eval loss | perplexity | "
            "nats/char | known words |") in markdown
    assert "| distributed | 2 | 30.0 s | 1.2 s | 1,331 | 1.10x | 55% | 5.3050 | 201.34 | 1.768 | 100% / 75% |" \
        in markdown
    assert distributed["known_words"]["top_k"] == 0.75 and distributed["nats_per_char"] == pytest.approx(5.305 / 3)
    # The samples section scores every model it shows.
    assert "| model | eval loss | nats/char | known words (greedy / top-k) |" in markdown
    assert "| baseline | 5.3000 | 1.767 | 100% / 75% |" in markdown
    assert [section["known_words"]["greedy"] for section in report["samples"]] == [1.0, 1.0]
    assert "efficiency is bounded by cores" in markdown
    assert ("Evaluation: the whole validation split, 2,560 tokens ('eval_tokens' = 1,000,000 asks for more than the "
            "split holds, so all of it is used), scored on 2 worker(s); the losses have no sampling error.") in markdown
    assert "tolerance ±0.0200 (the whole validation split: no sampling error)" in markdown
    for chart in ("loss_curves.png", "scaling.png"):
        assert read_bytes(join(prepared.report_url, chart)).startswith(PNG_MAGIC)
    assert sorted(evaluations()) == sorted([join(prepared.train_url, "model"),
                                            join(prepared.baseline_url, "model")])
    # The task log ends with the table.
    assert caplog.records[-1].getMessage().splitlines()[-2].startswith("distributed | 2 ")


def test_a_reused_baseline_is_not_trained_or_evaluated_again(root, evaluations):
    first = trained_run(root, "scheduled__1")
    evaluate_run(first, run_fixtures.own_run(first), make_backend)
    second = trained_run(root, "scheduled__2", train_time_s=25.0, baseline_time_s=99.0)  # 99: never written

    result = evaluate_run(second, run_fixtures.own_run(second), make_backend)

    assert second.baseline_key == first.baseline_key
    assert result.speedup == pytest.approx(33.0 / 25.0)  # the first baseline's time
    report = read_json(result.report_json_url)
    assert report["baseline"]["reused"] is True and report["baseline"]["trained_by_run"] == "scheduled__1"
    assert evaluations().count(join(first.baseline_url, "model")) == 1
    assert evaluations().count(join(second.train_url, "model")) == 1


def test_an_impossible_tolerance_fails_the_task_and_still_writes_the_report(root, evaluations):
    prepared = trained_run(root, "manual__gate", loss_tolerance=0.001, eval_loss=5.31, baseline_loss=5.30)

    with pytest.raises(GateFailure) as failure:
        evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)

    message = str(failure.value)
    assert "5.3100 - baseline 5.3000 = +0.0100 nats, tolerance ±0.0010" in message
    assert "'loss_tolerance'" in message and prepared.run_id in message
    report = read_json(join(prepared.report_url, "report.json"))
    assert report["gates_passed"] is False
    assert {gate["name"]: gate["passed"] for gate in report["gates"]} == {
        "eval_loss_finite": True, "same_work": True, "loss_parity": False}
    assert "**Gates: FAILED**" in run_fixtures.released_markdown(prepared.report_url)


def test_skip_reports_the_distributed_run_alone(root, evaluations):
    prepared = trained_run(root, "manual__skip", baseline="skip")

    result = evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)

    assert (result.speedup, result.efficiency, result.baseline_eval_loss) == (None, None, None)
    report = read_json(result.report_json_url)
    assert report["runs"]["baseline"] is None and [row["run"] for row in report["table"]] == ["distributed"]
    assert evaluations() == [join(prepared.train_url, "model")]


def test_an_unfinished_training_fails_fast_before_any_evaluation(root, evaluations):
    prepared = run_fixtures.prepare_run(root, "manual__1")
    run_fixtures.write_training_output(prepared.train_url, num_workers=2, train_time_s=30.0, eval_loss=5.3,
                                       complete=False)
    with pytest.raises(FileNotFoundError, match="'train' task did not complete"):
        evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)
    assert evaluations() == []
    assert not exists(join(prepared.report_url, "report.json"))


def test_a_failing_evaluation_names_the_model_and_shows_its_output(root, evaluations):
    prepared = trained_run(root, "manual__1", baseline="skip")
    compare_model = join(prepared.train_url, "model", "fixture_eval.json")
    os.remove(compare_model)

    with pytest.raises(EvaluationError) as failure:
        evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)

    assert "exited with code 3" in str(failure.value)
    assert join(prepared.train_url, "model") in str(failure.value)
    assert "fixture_eval.json missing" in str(failure.value)
    assert not exists(join(prepared.report_url, "report.json"))


def test_a_worker_failing_during_a_sharded_evaluation_fails_the_task_naming_its_rank(root, evaluations):
    prepared = trained_run(root, "manual__rank", baseline="skip")
    write_json_atomic(join(prepared.train_url, "model", "fixture_eval.json"), {"eval_loss": 5.3, "fail_rank": 1})

    with pytest.raises(EvaluationError) as failure:
        evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)

    message = str(failure.value)
    assert "on 2 worker(s) failed" in message and "rank 1" in message and "exited with code 3" in message
    assert "rank 1 lost its model files" in message  # the failed rank's last lines
    assert not exists(join(prepared.report_url, "report.json"))


def test_a_sampled_evaluation_reports_its_share_and_widens_loss_parity_by_the_paired_error(root, evaluations):
    """8 of the split's 40 sequences (eval_tokens = one batch of 8 x 64): each model's loss comes with its standard
    error, and the parity gate allows the delta two paired standard errors beyond the tolerance, saying so."""
    prepared = trained_run(root, "manual__sample", eval_tokens=512, loss_tolerance=0.001)
    for url, loss, spread in ((prepared.train_url, 5.305, 0.2), (prepared.baseline_url, 5.300, 0.1)):
        write_json_atomic(join(url, "model", "fixture_eval.json"), {"eval_loss": loss, "spread": spread})

    result = evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)

    report = read_json(result.report_json_url)
    assert report["eval_sample"]["tokens"] == 512 and report["eval_sample"]["split_tokens"] == 2560
    assert report["eval_sample"]["whole_split"] is False and report["eval_sample"]["workers"] == 2
    fpc = math.sqrt((40 - 8) / (40 - 1))  # the finite-population correction of 8 sequences of 40
    distributed = report["runs"]["distributed"]
    assert distributed["eval_loss"] == pytest.approx(5.305)
    assert distributed["eval_loss_se"] == pytest.approx(math.sqrt(8 * 0.2**2 / 7 / 8) * fpc)
    # The per-sequence deltas alternate 0.005 -+ 0.1: their error, far below the two models' errors together.
    delta_se = math.sqrt(8 * 0.1**2 / 7 / 8) * fpc
    assert report["comparison"]["loss_delta_se"] == pytest.approx(delta_se)
    (parity,) = [gate for gate in report["gates"] if gate["name"] == "loss_parity"]
    assert parity["passed"] and parity["limit"] == pytest.approx(0.001 + 2 * delta_se)
    assert f"limit ±{0.001 + 2 * delta_se:.4f} = tolerance 0.0010 + 2 x {delta_se:.4f}" in parity["detail"]
    assert "over 8 sampled sequences (both models scored the same sequences: paired)" in parity["detail"]
    markdown = run_fixtures.released_markdown(prepared.report_url)
    assert "Evaluation: 512 of 2,560 validation tokens (20.0%; 8 sequences), sample" in markdown
    assert f"| 5.3050 ± {distributed['eval_loss_se']:.4f} |" in markdown
    assert report["baseline"]["key"] != trained_run(root, "manual__all", eval_tokens=0).baseline_key


def test_an_evaluation_held_idle_past_the_reclaim_limit_fails_saying_so(root, evaluations):
    run = StorageLayout(root).run("run-of-eval")
    write_json_atomic(join(run.train.model, "fixture_eval.json"), {"eval_loss": 5.3, "hang_s": 120})  # never a step
    cfg = RunConfig.of(storage_root=root, max_idle_held_s=1, reclaim_idle_after_s=2)
    started = time.monotonic()
    with pytest.raises(evaluate.EvaluationError, match=r"on 2 worker\(s\): reclaimed after 2 s idle: GPU time: "
                                                        r"evaluate-distributed \(attempt 1\) held 2 slot"):
        evaluate.run_evaluation(Evaluation(run.train.model, run_fixtures.write_manifest(root),
                                           join(run.report, "eval.json"), "distributed", cfg, "run-of-eval"),
                                make_backend)
    assert time.monotonic() - started < 60


def test_evaluation_workers_refuse_a_manifest_other_than_the_pinned_one(root, evaluations):
    """Review t5, finding 11: evaluate's own workers pin the dataset as the operators' workers do."""
    from trainer.data import read_manifest

    run = StorageLayout(root).run("run-of-eval")
    write_json_atomic(join(run.train.model, "fixture_eval.json"), {"eval_loss": 5.3})
    manifest, output = run_fixtures.write_manifest(root), join(run.report, "eval.json")
    cfg = RunConfig.of(storage_root=root)
    with pytest.raises(evaluate.EvaluationError, match="the Airflow side pinned " + "0" * 64):
        evaluate.run_evaluation(Evaluation(run.train.model, manifest, output, "distributed", cfg, "run-of-eval",
                                           manifest_sha256="0" * 64), make_backend)
    result = evaluate.run_evaluation(Evaluation(run.train.model, manifest, output, "distributed", cfg, "run-of-eval",
                                                manifest_sha256=read_manifest(manifest)[1]), make_backend)
    assert result.eval_loss == pytest.approx(5.3)


def test_an_interrupted_evaluation_does_not_outlive_the_task(root, evaluations, caplog):
    """Airflow's execution_timeout raises from a SIGALRM handler while the task waits on the child."""
    caplog.set_level(logging.INFO, logger="gpt_finetune.evaluate")
    run = StorageLayout(root).run("run-of-eval")
    model = run.train.model
    write_json_atomic(join(model, "fixture_eval.json"), {"eval_loss": 5.3, "hang_s": 120})
    manifest = run_fixtures.write_manifest(root)

    def timeout(signum, frame):
        raise TimeoutError("execution_timeout")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with pytest.raises(TimeoutError):
            evaluate.run_evaluation(Evaluation(model, manifest, join(run.report, "eval.json"), "distributed",
                                               RunConfig(storage_root=root), "run-of-eval"), make_backend)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    lines = [r.getMessage() for r in caplog.records if "evaluating as pid" in r.getMessage()]
    assert 1 <= len(lines) <= 2  # a worker of each rank (the run's 2)
    for line in lines:
        assert line.endswith(" of run run-of-eval")  # the marker release finds the run's processes by
        with pytest.raises(ProcessLookupError):
            os.kill(int(line.split("evaluating as pid ")[1].split()[0]), 0)
    # Launched as training is (tasks/launch.py): a state record that release reads, the ranks' logs kept.
    record = read_json(run.state_file("evaluate-distributed"))
    assert (record["task_id"], record["backend"], record["state"]) == ("evaluate-distributed", "local", "failed")
    assert all(exists(join(run.logs("evaluate-distributed"), f"rank-{rank}.log")) for rank in (0, 1))


def test_real_trainer_output_evaluated_by_the_real_entry_point(root, tmp_path, caplog):
    """trainer.train's real summary, metrics and saved model, scored by `python -m trainer.evaluate`.

    One worker on both sides (the same job), so the comparison is exact: equal eval loss, speedup 1.
    """
    from tests.trainer.shards import write_dataset
    from trainer.train import main as train

    caplog.set_level(logging.INFO, logger="gpt_finetune.evaluate")
    manifest = write_dataset(Path(root) / "datasets", [REPO / "data" / "sample" / "macbeth_gut.txt"], block_size=32,
                             vocab_size=320, num_train_shards=2, max_chars=30_000)
    prepared = run_fixtures.prepare_run(
        root, "manual__real", manifest_url=manifest, num_workers=1, tokenizer="bpe:320", block_size=32,
        batch_size_per_worker=4, max_steps=4, warmup_steps=1, learning_rate=3e-3, checkpoint_every_steps=4)
    assert plan_baseline(prepared, run_fixtures.own_run(prepared)) is True
    assert train(["--config", prepared.config_url, "--manifest", manifest, "--output", prepared.train_url]) == 0
    shutil.copytree(prepared.train_url, prepared.baseline_url, dirs_exist_ok=True)

    result = evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)

    assert result.gates_passed and result.speedup == 1.0 and result.efficiency == 1.0
    assert result.eval_loss == result.baseline_eval_loss < math.log(320)
    report = read_json(result.report_json_url)
    distributed = report["runs"]["distributed"]
    summary = read_json(prepared.train_summary_url)
    assert distributed["tokens_per_s"] == summary["tokens_per_s"] > 0 and distributed["steps"] == 4
    assert distributed["eval_tokens"] > 0 and distributed["eval_time_s"] > 0
    assert report["hardware"]["line"].startswith(f"1 worker on a {os.cpu_count()}-core CPU")
    assert report["versions"]["tensorflow"] == metadata.version("tensorflow")  # the trainer's, as installed
    assert read_bytes(join(prepared.report_url, "loss_curves.png")).startswith(PNG_MAGIC)
    assert "[evaluate distributed 0] eval_loss" in caplog.text


def test_two_workers_evaluate_the_sample_as_one_does(tmp_path, caplog):
    """`trainer.evaluate` launched as evaluate launches it, on 1 and on 2 workers, on the same model and sample (a
    twentieth of a validation split of about 960 sequences): equal losses within 1e-5 nats. Prints both wall times."""
    import json
    import time

    from tests.trainer.shards import write_dataset
    from trainer.train import main as train

    caplog.set_level(logging.INFO, logger="gpt_finetune.evaluate")
    root = str(tmp_path / "storage")
    run = StorageLayout(root).run("one-and-two")  # evaluate launches only on the run's layout
    manifest = write_dataset(Path(root) / "datasets", sorted((REPO / "data" / "sample").glob("*.txt")),
                             block_size=32, vocab_size=320, num_train_shards=2, max_chars=30_000, val_fraction=0.5,
                             sequences_per_record=16)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_workers": 1, "model": "tiny", "tokenizer": "bpe:320", "block_size": 32,
                                  "batch_size_per_worker": 4, "max_steps": 4, "warmup_steps": 1}))
    assert train(["--config", str(config), "--manifest", manifest, "--output", run.train.url]) == 0
    split_tokens = read_json(manifest)["splits"]["validation"]["tokens"]
    results, times = {}, {}
    for workers in (1, 2):
        cfg = RunConfig(storage_root=root, num_workers=workers, block_size=32, eval_tokens=split_tokens // 20)
        started = time.perf_counter()
        results[workers] = evaluate.run_evaluation(
            Evaluation(run.train.model, manifest, join(run.report, f"eval-{workers}.json"), f"on-{workers}", cfg,
                       "one-and-two"), make_backend)
        times[workers] = time.perf_counter() - started
    one, two = results[1], results[2]
    print(f"evaluate wall time on the same model and sample ({one.sample['tokens']} of {split_tokens} tokens): "
          f"1 worker {times[1]:.1f} s, 2 workers {times[2]:.1f} s; eval loss {one.eval_loss:.8f} vs "
          f"{two.eval_loss:.8f}, |delta| {abs(one.eval_loss - two.eval_loss):.1e} nats")
    assert one.sample_id == two.sample_id and two.sample["workers"] == 2
    assert abs(one.eval_loss - two.eval_loss) < 1e-5
    combined = read_json(join(run.report, "eval-2.json"))  # the parts combined, then gone
    assert [worker["sequences"] for worker in combined["workers"]] == [24, 24]  # 48 sequences, half on each rank
    assert combined["eval_loss"] == two.eval_loss
    assert not exists(join(run.report, "eval-2.rank-0-of-2.json"))
    assert "[evaluate on-2 1] rank 1: 24 sequences scored" in caplog.text



def test_a_registry_pointer_outside_its_version_is_never_fetched(root, evaluations, internal_service):
    """Review t5 finding 2: evaluate fetched latest.json's model_url (its tokenizer), then launched workers on it."""
    from tasks import registry

    service, seen = internal_service
    prepared = trained_run(root, "manual__pointer", baseline="skip")
    layout = StorageLayout(root).model("gpt_finetune")
    version = layout.version(1)
    entry = registry.Entry(version="v1", number=1, url=version.url, model_url=version.model, run_id="r0",
                           run_key="r0-0123456789", promoted_at="2026-12-01T02:00:00+00:00", eval_loss=5.3,
                           perplexity=200.3, dataset_fingerprint=run_fixtures.FINGERPRINT, run_report_url="r")
    pointer = registry.Pointer.moved_to(entry, "gpt_finetune", None).to_xcom()
    write_json_atomic(layout.latest, {**pointer, "model_url": f"{service}/meta"})
    with pytest.raises(registry.RegistryError, match=f"Pointer.model_url = '{service}/meta' \\(it must be "
                                                     f"{version.model!r}\\)"):
        evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)
    assert seen == [] and evaluations() == [prepared.train_url + "/model"]  # the run's own model only
