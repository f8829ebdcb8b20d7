"""The scaling advisor: the ring model's figures by hand, the recommendation, and a real 2-worker preflight on the
CPU whose `min_predicted_efficiency` fails it before training, with the table in the message."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from core.config import RunConfig
from core.storage import read_json
from tests.trainer.shards import write_dataset
from trainer import advisor

REPO = Path(__file__).resolve().parents[2]


def _predict(**changes):
    settings = {"num_workers": 4, "single_step_s": 0.1, "gradient_bytes": 100_000_000, "busbw_gbps": 10.0,
                "latency_ms": 0.6, "measured_workers": 4, "tokens_per_step": 1000, "hosts": ["a", "b", "c", "d"],
                "shared_cores": False}
    return advisor.predict(advisor.Measured(**{**settings, **changes}))


def test_ring_model_by_hand():
    rows = _predict()["rows"]
    # 4 workers, own devices: compute 0.1 / 4; ring 2 x 3/4 x 1e8 B / 1e10 B/s = 15 ms; latency 0.6 ms over the
    # measured 6 hops = 0.1 ms per hop, x 6 hops x 3 collectives = 1.8 ms.
    four = rows[3]
    assert four["compute_s"] == pytest.approx(0.025)
    assert four["communication_s"] == pytest.approx(0.015 + 0.0018)
    assert four["step_time_s"] == pytest.approx(0.0418)
    assert four["step_time_overlap_s"] == pytest.approx(0.025)  # the ring hides behind compute
    assert four["speedup"] == pytest.approx(0.1 / 0.0418) and four["efficiency"] == pytest.approx(0.1 / 0.0418 / 4)
    assert four["tokens_per_s"] == pytest.approx(1000 / 0.0418)
    assert rows[0]["communication_s"] == 0 and rows[0]["speedup"] == pytest.approx(1.0)


def test_workers_sharing_a_hosts_cores_get_no_compute_speedup():
    rows = _predict(hosts=["a"] * 4, shared_cores=True)["rows"]
    assert [row["compute_s"] for row in rows] == pytest.approx([0.1] * 4)  # k workers on one host: 1/k the speed
    assert all(row["speedup"] < 1 for row in rows[1:])
    two_hosts = _predict(hosts=["a", "a", "b", "b"], shared_cores=True)["rows"]
    assert two_hosts[3]["compute_s"] == pytest.approx(0.1 * 2 / 4) and two_hosts[1]["workers_per_host"] == 2


def test_recommendation_names_the_asked_count_and_a_better_one():
    # 1 s steps, a slow network with slow hops: 4 workers gain little over 3 (1.72x vs 1.70x).
    slow_network = _predict(single_step_s=1.0, busbw_gbps=1.0, latency_ms=60.0)
    rows = {row["num_workers"]: row for row in slow_network["rows"]}
    assert [round(rows[n]["speedup"], 2) for n in (2, 3, 4)] == [1.52, 1.70, 1.72]
    assert slow_network["recommended_workers"] == 3
    assert slow_network["recommendation"] == "4 workers: predicted 43% efficiency (1.72x); 3 workers reach 1.70x at 57%"
    assert _predict(busbw_gbps=1000.0)["recommendation"].endswith("the best choice up to 4 workers")
    shared = _predict(hosts=["a"] * 4, shared_cores=True)
    assert shared["recommended_workers"] == 1 and "1 worker is predicted as fast or faster" in shared["recommendation"]


def test_packs_hide_communication_behind_the_last_backward_pass_by_hand():
    # 2 workers, 100 MB in 4 packs of 25 MB: 2 x 1/2 x 1e8 B / 1e9 B/s = 100 ms of ring, no latency. The one
    # micro-step's backward is 2/3 of the compute (0.3 / 2 = 150 ms): 100 ms, so 100 - 100 = 0 would be hidden, but
    # the last pack (ready only when backward ends) still shows: 25 ms.
    settings = {"num_workers": 2, "single_step_s": 0.3, "gradient_bytes": 100_000_000, "busbw_gbps": 1.0,
                "latency_ms": 0.0, "measured_workers": 2, "tokens_per_step": 1000, "hosts": ["a", "b"],
                "shared_cores": False}
    one_pack = advisor.predict(advisor.Measured(**settings))["rows"][1]
    packed = advisor.predict(advisor.Measured(**settings, packs=[25_000_000] * 4, micro_steps=2))["rows"][1]
    assert one_pack["exposed_communication_s"] == pytest.approx(0.1) and one_pack["step_time_s"] == pytest.approx(0.25)
    # micro_steps=2 global micro-batches: the last one's backward on a worker is 2/3 x 0.3 / 2 = 100 ms.
    assert packed["communication_s"] == pytest.approx(0.1)
    assert packed["exposed_communication_s"] == pytest.approx(0.025)
    assert packed["step_time_s"] == pytest.approx(0.175)


def test_the_levers_name_the_one_that_helps_most_on_this_network():
    step = {"seconds_per_step": 0.2, "parameters": 25_000_000, "variable_parameters": [10_000_000] + [1_250_000] * 12,
            "gradient_dtype": "float32", "source": "probe"}
    slow = {"bandwidth": {"busbw_gbps": 0.1}, "latency": {"p50_ms": 0.5}}
    workers = [{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}]
    advice = advisor.advise(cfg=RunConfig(num_workers=2, use_gpu=False, allreduce_pack_mb=0), collectives=slow,
                            workers=workers, step=step)
    settings = [lever["setting"] for lever in advice["levers"]]
    assert settings[0] == "grad_accum_steps"  # a link this slow: a 4x batch gains the most
    assert sorted(settings) == ["allreduce_dtype", "allreduce_pack_mb", "grad_accum_steps", "grad_accum_steps"]
    bf16 = next(lever for lever in advice["levers"] if lever["setting"] == "allreduce_dtype")
    # The communication lever is named first: it keeps the recipe.
    assert advice["recommendation"].endswith(
        f"; bfloat16 on the wire ('allreduce_dtype') is predicted to raise efficiency from "
        f"{bf16['from_efficiency']:.0%} to {bf16['efficiency']:.0%} on this network")
    # Already bfloat16 in packs: only a larger global batch is left, the smallest that helps enough.
    tuned = advisor.advise(cfg=RunConfig(num_workers=2, allreduce_dtype="bfloat16", allreduce_pack_mb=8),
                           collectives=slow, workers=workers, step=step)
    assert [lever["lever"][:12] for lever in tuned["levers"]] == ["a 4x global ", "a 2x global "]
    assert "a 2x global batch (more tokens per all-reduce) ('grad_accum_steps')" in tuned["recommendation"]
    assert tuned["inputs"]["gradient_bytes"] == 50_000_000 and tuned["inputs"]["packs"] > 1
    # A network fast enough that no lever gains 5 points: nothing is proposed.
    fast = advisor.advise(cfg=RunConfig(num_workers=2), collectives={"bandwidth": {"busbw_gbps": 1000.0},
                          "latency": {"p50_ms": 0.01}}, workers=workers, step=step)
    assert "raise efficiency" not in fast["recommendation"]


def test_the_levers_never_offer_a_setting_the_run_cannot_take():
    """NCCL cannot carry bfloat16 (the config refuses the pair), so a run on NCCL, `auto` with `use_gpu` among them,
    is not told to put bfloat16 on the wire; nor is a run told to grow its batch past the accumulation limit."""
    step = {"seconds_per_step": 0.2, "parameters": 25_000_000, "variable_parameters": [10_000_000] + [1_250_000] * 12,
            "gradient_dtype": "float32", "source": "probe"}
    slow = {"bandwidth": {"busbw_gbps": 0.1}, "latency": {"p50_ms": 0.5}}
    workers = [{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}]

    def settings(cfg):
        advice = advisor.advise(cfg=cfg, collectives=slow, workers=workers, step=step)
        return sorted(lever["setting"] for lever in advice["levers"]), advice["recommendation"]

    for communication in ("auto", "nccl"):
        offered, recommendation = settings(RunConfig(num_workers=2, use_gpu=True, communication=communication,
                                                     allreduce_pack_mb=0))
        assert offered == ["allreduce_pack_mb", "grad_accum_steps", "grad_accum_steps"], communication
        assert "bfloat16" not in recommendation
    offered, _ = settings(RunConfig(num_workers=2, use_gpu=True, communication="ring", allreduce_pack_mb=0))
    assert "allreduce_dtype" in offered  # a ring carries bfloat16
    near_the_limit = RunConfig(num_workers=2, grad_accum_steps=512, allreduce_dtype="bfloat16")
    found = advisor.advise(cfg=near_the_limit, collectives=slow, workers=workers, step=step)["levers"]
    assert [lever["lever"] for lever in found] == ["a 2x global batch (more tokens per all-reduce)"]


def test_the_gate_fails_below_the_limit_with_the_table():
    advice = advisor.advise(
        cfg=RunConfig.of(num_workers=2, min_predicted_efficiency=0.9),
        collectives={"bandwidth": {"busbw_gbps": 0.4}, "latency": {"p50_ms": 1.0}},
        workers=[{"rank": 0, "host": "h"}, {"rank": 1, "host": "h"}],
        step={"seconds_per_step": 0.05, "parameters": 250_000, "gradient_dtype": "float32", "source": "probe"},
    )
    assert advice["inputs"]["gradient_bytes"] == 1_000_000 and advice["inputs"]["shared_cores"] is True
    message = advisor.efficiency_error(advice)
    assert message.startswith("2 workers are predicted at ") and "'min_predicted_efficiency' = 0.9" in message
    assert "workers   step ms" in message and "recommendation: 2 workers: predicted" in message
    assert advisor.efficiency_error({**advice, "min_predicted_efficiency": 0.0}) is None


def test_a_baseline_summary_stands_in_for_the_probe_only_when_complete():
    summary = {"num_workers": 1, "steps_timed": 9, "train_time_s": 0.9, "parameters": 10, "gradient_dtype": "float32"}
    assert advisor.step_from_summary(summary) == {"seconds_per_step": pytest.approx(0.1), "parameters": 10,
                                                  "variable_parameters": None, "gradient_dtype": "float32",
                                                  "source": "baseline summary"}
    assert advisor.step_from_summary({**summary, "parameters": None}) is None  # written before the advisor
    assert advisor.step_from_summary({**summary, "num_workers": 2}) is None


def test_min_predicted_efficiency_fails_a_two_worker_cpu_preflight_in_seconds_with_the_table(tmp_path):
    from launcher import GroupSpec, LocalBackend, WorkerGroup

    manifest = write_dataset(tmp_path / "dataset", sorted((REPO / "data" / "sample").glob("*.txt")), block_size=32,
                             vocab_size=320, num_train_shards=4, max_chars=20_000)
    cfg = RunConfig.of(num_workers=2, model="tiny", tokenizer="bpe:320", block_size=32, batch_size_per_worker=4,
                    max_steps=10, warmup_steps=1, storage_root=str(tmp_path), collective_timeout_s=60,
                    min_predicted_efficiency=0.9)
    (tmp_path / "config.json").write_text(cfg.to_json())
    output = tmp_path / "report"
    lines: list[str] = []
    spec = GroupSpec(name="preflight", entrypoint="trainer.preflight", num_workers=2,
                     args=("--config", str(tmp_path / "config.json"), "--manifest", manifest, "--output", str(output),
                           "--baseline-summary", str(tmp_path / "no-baseline" / "summary.json")),
                     env={"TF_CPP_MIN_LOG_LEVEL": "3"}, startup_timeout_s=120, hang_timeout_s=120)
    started = time.monotonic()
    result = WorkerGroup(spec, LocalBackend(), tmp_path / "work", on_line=lambda rank, line: lines.append(line)).run()
    elapsed = time.monotonic() - started
    report = read_json(str(output / "preflight.json"))
    log = "\n".join(lines)
    print(f"\npreflight with min_predicted_efficiency 0.9: failed after {elapsed:.1f} s\n"
          + "\n".join(line for line in lines if line.startswith("  ")))
    assert not result.succeeded and report["status"] == "failed"
    advice = report["advisor"]
    assert [row["num_workers"] for row in advice["rows"]] == [1, 2]
    assert advice["inputs"]["step_source"] == "probe" and advice["inputs"]["parameters"] > 0
    assert advice["inputs"]["busbw_gbps"] == report["collectives"]["bandwidth"]["busbw_gbps"]
    assert advice["asked"]["efficiency"] < 0.9  # two workers share the cores of one host
    assert report["errors"] == [advice["error"]] and "'min_predicted_efficiency' = 0.9" in advice["error"]
    assert f"scaling advisor (single-worker step from the probe, {advice['inputs']['parameters']:,} parameters" in log
    assert "recommendation: 2 workers" in log
    # The task log's error carries the table.
    assert "ERROR: 2 workers are predicted at" in log and log.count("workers   step ms") == 2
