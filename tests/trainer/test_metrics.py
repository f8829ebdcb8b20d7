"""What a training run reports: the chief's TensorBoard file (read back with TensorFlow's own event reader), the
live metrics lines, and the loss watch that fails a diverging run."""

from __future__ import annotations

import json
import logging
import math
import socket

import pytest

from tests.support import fake_nvml
from trainer import metrics
from trainer.metrics import LIVE_INTERVAL_ENV, LIVE_PREFIX, LiveMetrics, LossDivergedError, LossWatch, TensorBoardLog


def _record(step: int, loss: float = 4.0) -> dict:
    return {"step": step, "loss": loss, "learning_rate": 1e-3, "tokens_per_s": 900.0, "step_time_s": 0.5,
            "input_wait_s": 0.1, "tokens_seen": 64 * step, "time": 0.0, "grad_norm": 1.5}


def _live_lines(output: str) -> list[dict]:
    return [json.loads(line[len(LIVE_PREFIX):]) for line in output.splitlines() if line.startswith(LIVE_PREFIX)]


def test_live_lines_first_step_then_at_most_one_per_interval_and_the_last(capsys, monkeypatch):
    clock = iter([0.0, 0.5, 1.0, 2.5, 2.6, 2.7])
    monkeypatch.setattr("trainer.metrics.time.monotonic", lambda: next(clock))
    live = LiveMetrics(total_steps=6, environ={LIVE_INTERVAL_ENV: "2"})
    for step in range(1, 7):
        live.maybe_print(_record(step))
    lines = _live_lines(capsys.readouterr().out)
    assert [line["values"]["step"] for line in lines] == [1, 4, 6]
    assert lines[0] == {"scope": "worker", "values": {
        "step": 1, "loss": 4.0, "learning_rate": 1e-3, "tokens_per_s": 900.0, "step_time_s": 0.5,
        "input_wait_s": 0.1, "grad_norm": 1.5, "compute_s": pytest.approx(0.4)}}


def test_no_live_lines_unless_the_operator_asks(capsys):
    live = LiveMetrics(total_steps=2, environ={})
    live.maybe_print(_record(1))
    live.maybe_print(_record(2))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_loss_that_is_not_finite_fails_naming_rank_step_and_the_lowest_loss(bad):
    watch = LossWatch(rank=1, max_rise=0.0)
    watch.check(1, 5.0)
    watch.check(2, 4.5)
    with pytest.raises(LossDivergedError, match=rf"rank 1: the training loss is {bad} at step 3 \(lowest so far "
                                                 r"4.5000 at step 2\): lower 'learning_rate'"):
        watch.check(3, bad)


def test_a_loss_far_above_its_running_minimum_fails_with_both_values():
    watch = LossWatch(rank=0, max_rise=3.0)
    for step, loss in enumerate([7.6, 6.0, 4.0, 6.9, 5.0], start=1):  # 6.9 is 2.9 above the lowest: still fine
        watch.check(step, loss)
    with pytest.raises(LossDivergedError, match=r"rank 0: the training loss diverged at step 6: 7.1000 is 3.10 nats "
                                                r"above its lowest so far \(4.0000 at step 3; the limit "
                                                r"'max_loss_rise' is 3\)"):
        watch.check(6, 7.1)


def test_the_divergence_check_is_off_at_zero():
    watch = LossWatch(rank=0, max_rise=0.0)
    for step, loss in enumerate([5.0, 1.0, 70.0], start=1):
        watch.check(step, loss)


def test_tensorboard_events_are_what_tf_summary_scalar_writes(tmp_path):
    tf = pytest.importorskip("tensorflow")
    log = TensorBoardLog(tmp_path / "tensorboard")
    for step in (1, 2, 3):
        log.write(step, {"loss": 5.0 - step, "learning_rate": 1e-3 * step})
    log.close()

    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*.v2"))
    assert len(files) == 1
    events = list(tf.compat.v1.train.summary_iterator(str(files[0])))
    assert events[0].file_version == "brain.Event:2"
    scalars = {}
    for event in events[1:]:
        for value in event.summary.value:
            assert value.metadata.plugin_data.plugin_name == "scalars"
            scalars[(event.step, value.tag)] = float(tf.make_ndarray(value.tensor))
    assert scalars == pytest.approx({(s, tag): v for s in (1, 2, 3)
                                     for tag, v in (("loss", 5.0 - s), ("learning_rate", 1e-3 * s))})

    # Exactly the record tf.summary.scalar's op writes for the same value: same tensor, same metadata.
    with tf.summary.create_file_writer(str(tmp_path / "reference")).as_default(step=1):
        tf.summary.write("loss", tf.constant(4.0, tf.float32), metadata=events[1].summary.value[0].metadata
                         .SerializeToString())
    reference = next(e for f in (tmp_path / "reference").glob("events.out.tfevents.*")
                     for e in tf.compat.v1.train.summary_iterator(str(f)) if e.summary.value).summary.value[0]
    assert reference.tensor == events[1].summary.value[0].tensor
    assert reference.metadata == events[1].summary.value[0].metadata


# -- the GPU sampler on the fake NVML (tests/support/fake_nvml.py): NVML errors after start-up never end training --


@pytest.fixture
def nvml(monkeypatch):
    """One H200, this worker's (CUDA_VISIBLE_DEVICES=0), with 40 GiB in use: TensorFlow's reservation."""
    fake = fake_nvml.install(monkeypatch, fake_nvml.FakeNvml(fake_nvml.h200s(1)))
    fake.start_process(0, 40 * fake_nvml.GIB - fake_nvml.MEASURED_IDLE_USED_BYTES)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return fake


def _sampler_lines(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "trainer.metrics"]


def test_sampler_reports_utilization_memory_in_use_and_tensorflows_peak(nvml):
    sampler = metrics.GpuSampler(enabled=True, read_peak_mb=lambda: 3072.0)
    assert sampler.sample() == {"gpu_util": 97.0, "gpu_mem_reserved_mb": 40960.0, "gpu_mem_peak_mb": 3072.0}
    assert sampler.name == "NVIDIA H200" and sampler.last["gpu_mem_peak_mb"] == 3072.0


def test_on_a_mig_gpu_the_sampler_drops_utilization_once_and_keeps_the_rest(nvml, caplog):
    """nvmlDeviceGetUtilizationRates is NotSupported on MIG-enabled GPUs: today's sampler raised it after step 1."""
    nvml.gpus[0].mig = True
    sampler = metrics.GpuSampler(enabled=True)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        samples = [sampler.sample() for _ in range(3)]
    assert samples == [{"gpu_mem_reserved_mb": 40960.0}] * 3
    assert nvml.calls.count("nvmlDeviceGetUtilizationRates") == 1  # asked once, then no more
    (line,) = _sampler_lines(caplog)
    assert (f"host {socket.gethostname()}, GPU 0 (NVIDIA H200): NVML refused gpu_util (Not Supported, as on "
            "MIG-enabled GPUs): no more gpu_util samples; training goes on") == line


def test_a_figure_nvml_stops_permitting_mid_run_is_dropped_and_said_once(nvml, caplog):
    sampler = metrics.GpuSampler(enabled=True)
    assert sampler.sample()["gpu_util"] == 97.0
    nvml.gpus[0].errors["nvmlDeviceGetMemoryInfo"] = fake_nvml.NVML_ERROR_NO_PERMISSION
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        assert [sampler.sample() for _ in range(3)] == [{"gpu_util": 97.0}] * 3
    assert nvml.calls.count("nvmlDeviceGetMemoryInfo") == 2
    (line,) = _sampler_lines(caplog)
    assert "GPU 0 (NVIDIA H200): NVML refused gpu_mem_reserved_mb (Insufficient Permissions)" in line
    assert socket.gethostname() in line


def test_a_gpu_lost_mid_run_ends_its_nvml_samples_with_one_line_naming_host_and_gpu(nvml, caplog):
    sampler = metrics.GpuSampler(enabled=True)
    sampler.sample()
    nvml.lose(0)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        assert [sampler.sample() for _ in range(3)] == [{}] * 3
    calls = len(nvml.calls)
    sampler.sample()
    assert len(nvml.calls) == calls  # NVML is not asked about a lost GPU again
    (line,) = _sampler_lines(caplog)
    assert line.startswith(f"host {socket.gethostname()}, GPU 0 (NVIDIA H200): the GPU is lost (NVML: GPU is lost;")
    assert sampler.last["gpu_mem_reserved_mb"] == 40960.0  # the summary keeps the last figure it had


def test_a_gpu_pinned_by_uuid_is_named_by_its_uuid(nvml, monkeypatch, caplog):
    uuid = nvml.gpus[0].uuid
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid)
    sampler = metrics.GpuSampler(enabled=True)
    nvml.lose(0)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        assert sampler.sample() == {}
    assert f"{uuid} (NVIDIA H200): the GPU is lost" in _sampler_lines(caplog)[0]


def test_tensorflows_peak_outlives_a_lost_gpu_and_ends_once_tensorflow_has_none(nvml, caplog):
    peaks = iter([3072.0, 3100.0, None])
    sampler = metrics.GpuSampler(enabled=True, read_peak_mb=lambda: next(peaks))
    nvml.lose(0)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        samples = [sampler.sample() for _ in range(4)]
    assert samples == [{"gpu_mem_peak_mb": 3072.0}, {"gpu_mem_peak_mb": 3100.0}, {}, {}]
    assert [line.split(": ")[1] for line in _sampler_lines(caplog)] == [
        "the GPU is lost (NVML", "TensorFlow keeps no memory statistics for this GPU"]


def test_without_tensorflow_memory_statistics_the_peak_is_dropped_once(nvml, caplog):
    sampler = metrics.GpuSampler(enabled=True, read_peak_mb=lambda: None)
    with caplog.at_level(logging.INFO, logger="trainer.metrics"):
        assert [sampler.sample() for _ in range(2)] == [{"gpu_util": 97.0, "gpu_mem_reserved_mb": 40960.0}] * 2
    assert len(_sampler_lines(caplog)) == 1 and "no gpu_mem_peak_mb samples" in _sampler_lines(caplog)[0]


def test_tensorflows_peak_is_none_on_a_cpu_host():
    """TF 2.21's get_memory_info("GPU:0") raises ValueError ("No matching devices found") without a GPU."""
    pytest.importorskip("tensorflow")
    assert metrics.tensorflow_peak_mb() is None


def test_tensorflows_peak_is_its_allocators_peak_in_mib(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    asked = []

    def get_memory_info(device):
        asked.append(device)
        return {"current": 1 << 30, "peak": 3 * (1 << 30) + 512 * 1024}

    monkeypatch.setattr(tf.config.experimental, "get_memory_info", get_memory_info)
    assert metrics.tensorflow_peak_mb() == 3072.5 and asked == ["GPU:0"]
