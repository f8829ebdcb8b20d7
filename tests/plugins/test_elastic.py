"""Exact elastic recovery (tf_multiworker/elastic.py): the count chosen from what is usable, and a real 4-worker
training task, failed at a checkpointed step, whose retry has only 2 usable workers and continues on 2 x 2
accumulation steps, through Airflow's task runner, matching an uninterrupted 4-worker run step for step."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from tf_multiworker.backends import make_backend
from tf_multiworker.elastic import ElasticTrainOperator, choose_count

from core.config import RunConfig
from core.config.pinned import ConfigChangedError, load_pinned_config, save_config
from core.layout import StorageLayout, TrainOutput, run_key
from core.protocol import CONFIG_SHA256_ENV
from core.storage import join, read_bytes, read_json, write_json_atomic
from launcher import GroupSpec, LaunchError, LocalBackend, WorkerGroup
from launcher.backend import Capacity, HostRelease
from launcher.gpus import Gpu, GpuInventory
from launcher.local import LOCAL_USABLE_WORKERS_ENV
from tests.launcher.conftest import REPO, entrypoint_env
from tests.plugins.conftest import failure_excerpt
from tests.plugins.test_operator import _finish, _start
from tests.tasks import run_fixtures
from tests.trainer.shards import write_dataset
from trainer.data import read_manifest

LOSS_TOLERANCE = 1e-4
STEPS, CHECKPOINT_EVERY, FAULT_STEP = 12, 4, 4


def test_the_largest_exact_count_that_fits_is_chosen():
    cfg = RunConfig.from_params({"num_workers": 4, "min_workers": 2})
    assert [choose_count(cfg, Capacity(workers)) for workers in (4, 3, 2)] == [4, 2, 2]  # 3 does not split 4 slots
    with pytest.raises(LaunchError) as raised:
        choose_count(cfg, Capacity(1, ("host 10.0.0.2 unreachable",)))
    message = str(raised.value)
    assert "only 1 of 4 workers are usable (host 10.0.0.2 unreachable), below 'min_workers' = 2" in message
    assert "exact worker counts for this run are [4, 2]" in message


def test_local_capacity_reads_the_cap_and_the_free_gpus():
    group = GroupSpec(name="train", entrypoint="trainer.train", num_workers=4)

    def capacity(environ, **changes):
        gpus = GpuInventory(tuple(Gpu(index) for index in (0, 1, 2)))
        return LocalBackend(gpu_probe=lambda: gpus, environ=environ).capacity(replace(group, **changes))

    assert capacity({}) == Capacity(4)
    assert capacity({LOCAL_USABLE_WORKERS_ENV: "2"}) == Capacity(
        2, (f"this machine allows 2 worker(s) ({LOCAL_USABLE_WORKERS_ENV}=2)",))
    assert capacity({}, use_gpu=True) == Capacity(3, ("this machine has 3 free GPU(s) [0, 1, 2]",))
    with pytest.raises(LaunchError, match="not a whole number"):
        capacity({LOCAL_USABLE_WORKERS_ENV: "two"})


# -- the must-show run ---------------------------------------------------------------------------------------------

def _losses(output: TrainOutput) -> dict[int, float]:
    lines = Path(output.metrics_file(0)).read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def test_a_retry_with_two_usable_workers_continues_a_four_worker_run_exactly(airflow_env, tmp_path):
    from tasks.checked_run import Evaluation
    from tasks.evaluate import evaluate_run, run_evaluation
    from tasks.prepare import PublishedManifest, lay_out_run

    storage = str(tmp_path / "storage")
    manifest = write_dataset(Path(storage) / "datasets", sorted((REPO / "data" / "sample").glob("*.txt")),
                             block_size=32, vocab_size=320, num_train_shards=4, max_chars=20_000)
    key = run_key(run_fixtures.DAG_ID, "elastic")
    run = StorageLayout(storage).run(key)
    cfg = RunConfig.of(num_workers=4, min_workers=2, model="tiny", tokenizer="bpe:320", block_size=32,
                       batch_size_per_worker=2, max_steps=STEPS, warmup_steps=2, learning_rate=3e-3, num_shards=4,
                       checkpoint_every_steps=CHECKPOINT_EVERY, storage_root=storage, baseline="skip",
                       startup_timeout_s=240, hang_timeout_s=240)
    # Laid out as publish lays a run out: the operator pins the digest of this configuration, its run_config.
    manifest_document, manifest_sha256 = read_manifest(manifest)
    prepared = lay_out_run(cfg, PublishedManifest(manifest_document, manifest, manifest_sha256), key, run_id="elastic")

    # The uninterrupted 4-worker run, side by side with the elastic one.
    reference_run = StorageLayout(storage).run("reference-run")
    reference = reference_run.train
    reference_spec = GroupSpec(name="reference", entrypoint="trainer.train", num_workers=4, env=entrypoint_env(),
                               args=("--config", run.config, "--manifest", manifest, "--output", reference.url),
                               startup_timeout_s=240, hang_timeout_s=240)
    reference_result = {}
    thread = threading.Thread(target=lambda: reference_result.update(result=WorkerGroup(
        reference_spec, LocalBackend(), tmp_path / "reference-work", on_line=lambda rank, line: None).run()))
    thread.start()

    case = {
        "entrypoint": "faulty_train", "operator": "elastic", "retries": 1,
        "args": ["--manifest", manifest],
        "operator_args": {"config_url": run.config, "output_url": run.train.url,
                          "manifest_sha256": prepared.manifest_sha256},
        "env": entrypoint_env(),
        "env_by_try": {"1": {"TFMW_TEST_TRAIN_FAULT": f"3:{FAULT_STEP}", LOCAL_USABLE_WORKERS_ENV: None},
                       "2": {"TFMW_TEST_TRAIN_FAULT": None, LOCAL_USABLE_WORKERS_ENV: "2"}},
        "params": {"run_key": key, "run_config": cfg.to_dict()},
    }
    case_file = tmp_path / "case.json"
    case_file.write_text(json.dumps(case))
    process, out, log = _start(airflow_env, case_file, tmp_path)
    _finish(process, timeout=600)
    thread.join(timeout=600)
    task_log = log.read_text(errors="replace")
    result = json.loads(out.read_text())
    assert result["task_states"]["group"] == "success", failure_excerpt(task_log)
    assert reference_result["result"].succeeded, reference_result["result"].error_message()

    # The first try lost rank 3 after the checkpoint of step 4; the retry continued on 2 workers from there.
    assert "rank 3 (host 127.0.0.1" in task_log and "killed by SIGKILL" in task_log
    assert (f"continued on 2 of 4 workers from step {FAULT_STEP}: this machine allows 2 worker(s) "
            f"({LOCAL_USABLE_WORKERS_ENV}=2); 2 accumulation steps per worker keep the global batch at 8") in task_log
    launches = read_json(run.train.segments)["launches"]
    assert [(s["try_number"], s["from_step"], s["num_workers"], s["grad_accum_steps"]) for s in launches] == [
        (1, 0, 4, 1), (2, FAULT_STEP, 2, 2)]
    summary = read_json(run.train.summary)
    assert (summary["num_workers"], summary["global_batch_size"], summary["steps"]) == (2, 8, STEPS)
    assert summary["resumed_from_step"] == FAULT_STEP and summary["data_order"] == "per_slot"

    # Every step's loss as in the uninterrupted run: 4 x 1 before the fault, 2 x 2 after it.
    elastic, uninterrupted = _losses(run.train), _losses(reference)
    assert sorted(elastic) == sorted(uninterrupted) == list(range(1, STEPS + 1))
    worst = max(abs(elastic[step] - uninterrupted[step]) for step in elastic)
    print(f"\nelastic 4 -> 2 workers from step {FAULT_STEP}: max per-step loss difference {worst:.2e}")
    assert worst < LOSS_TOLERANCE

    # The report names both segments; the final models evaluate alike.
    evaluation = evaluate_run(prepared, run_fixtures.own_run(prepared), make_backend)
    markdown = run_fixtures.released_markdown(run.report)
    assert "**elastic**: continued on 2 of 4 workers from step 4: this machine allows 2 worker(s)" in markdown
    assert "| 1-4 | 4 of 4 | 1 |" in markdown and "| 5-12 | 2 of 4 | 2 |" in markdown
    report = read_json(str(Path(run.report) / "report.json"))
    assert report["elastic"] is True and [s["steps"] for s in report["segments"]] == [FAULT_STEP, STEPS - FAULT_STEP]
    assert all(s["tokens_per_s"] > 0 for s in report["segments"])
    reference_eval = run_evaluation(Evaluation(reference.model, manifest, join(reference_run.report, "eval.json"),
                                               "reference", cfg, "reference-run"), make_backend)
    delta = abs(evaluation.eval_loss - reference_eval.eval_loss)
    print(f"eval loss elastic {evaluation.eval_loss:.6f} vs uninterrupted {reference_eval.eval_loss:.6f}: "
          f"|delta| {delta:.2e}")
    assert math.isfinite(delta) and delta < LOSS_TOLERANCE


def test_an_earlier_attempts_orphans_are_ended_before_capacity_is_counted():
    """With use_gpu the orphans hold GPUs until ended: counted first, they shrank the retry for the rest of the run
    (review section 5)."""
    calls = []

    class CountingStopped(Exception):
        pass

    class RecordingBackend(LocalBackend):
        def end_earlier_attempts(self, group):
            calls.append("end_earlier_attempts")
            return [HostRelease("gpu-host-1", found=({"pid": 4242, "cmdline": "python -m trainer.train"},),
                                terminated=(4242,))]

        def capacity(self, group):
            calls.append("capacity")
            raise CountingStopped

    cfg = RunConfig(num_workers=4, min_workers=2, model="tiny", tokenizer="bpe:320", block_size=32, use_gpu=True)
    operator = ElasticTrainOperator(task_id="train", entrypoint="trainer.train", run_config=cfg.to_dict(),
                                    config_url="config.json", output_url="train", run_key="elastic-run")
    spec = GroupSpec(name="train", entrypoint="trainer.train", num_workers=4, use_gpu=True, run_key="elastic-run",
                     args=operator.worker_args("config.json"))
    with pytest.raises(CountingStopped):
        operator.plan_group({}, spec, RecordingBackend())
    assert calls == ["end_earlier_attempts", "capacity"]


def test_the_config_of_fewer_workers_is_pinned_on_its_workers_in_place_of_the_run_s(tmp_path):
    """The elastic operator writes config-2-workers.json itself: the workers get that file's digest, and refuse the
    file once it is rewritten on storage."""
    import hashlib

    class TwoUsable(LocalBackend):
        def capacity(self, group):
            return Capacity(2, ("host h unreachable",))

    storage = str(tmp_path / "storage")
    run = StorageLayout(storage).run("elastic-run")
    cfg = RunConfig(num_workers=4, min_workers=2, model="tiny", tokenizer="bpe:320", block_size=32,
                    storage_root=storage)
    run_digest = save_config(run.config, cfg)
    operator = ElasticTrainOperator(task_id="train", entrypoint="trainer.train", run_config=cfg.to_dict(),
                                    config_url=run.config, output_url=run.train.url, run_key="elastic-run")
    spec = GroupSpec(name="train", entrypoint="trainer.train", num_workers=4, env={CONFIG_SHA256_ENV: run_digest},
                     args=operator.worker_args(run.config))
    planned = operator.plan_group({"ti": type("TI", (), {"try_number": 1})()}, spec, TwoUsable())

    config_url = planned.args[planned.args.index("--config") + 1]
    assert config_url == run.train.url + "/config-2-workers.json" and planned.num_workers == 2
    assert planned.env[CONFIG_SHA256_ENV] == hashlib.sha256(read_bytes(config_url)).hexdigest() != run_digest
    assert load_pinned_config(config_url, planned.env).grad_accum_steps == 2
    write_json_atomic(config_url, {**read_json(config_url), "model": "http://169.254.169.254/latest/"})
    with pytest.raises(ConfigChangedError, match=f"{config_url} has sha256 .* changed after the Airflow side"):
        load_pinned_config(config_url, planned.env)
