"""launcher/log_policy.py: library chatter is left out, narrowly, and all of it comes back
when verbose."""

import logging
import warnings

import pytest

from launcher import log_policy


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.delenv(log_policy.VERBOSE_ENV, raising=False)
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).filters))
             for name in {*log_policy.ROUTINE_LOGGERS, *(name for name, _ in log_policy.KNOWN_RECORDS)}}
    with warnings.catch_warnings():
        yield
    for name, (level, filters) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).filters[:] = filters


def test_routine_library_info_is_left_out_but_their_warnings_stay(quiet, caplog):
    logging.getLogger("paramiko").setLevel(logging.NOTSET)
    log_policy.quiet_libraries()
    with caplog.at_level(logging.INFO):
        logging.getLogger("paramiko.transport").info("Connected (version 2.0, client OpenSSH_9.6)")
        logging.getLogger("botocore.credentials").info("Found credentials in environment variables.")
        logging.getLogger("paramiko.transport").warning("Oops, unhandled type 3")
        logging.getLogger("trainer.train").info("rank 0 of 2 joined")
    assert [record.getMessage() for record in caplog.records] == ["Oops, unhandled type 3", "rank 0 of 2 joined"]


def test_known_library_records_are_dropped_by_message_and_others_kept(quiet, caplog):
    log_policy.quiet_libraries()
    log_policy.quiet_libraries()  # twice: still one filter per pattern
    tensorflow = logging.getLogger("tensorflow")  # where TensorFlow logs it
    assert len(tensorflow.filters) == sum(name == tensorflow.name for name, _ in log_policy.KNOWN_RECORDS)
    with caplog.at_level(logging.INFO):
        tensorflow.warning("Using CollectiveAllReduceStrategy eagerly has significant overhead currently.")
        tensorflow.warning("Collective ops is not configured at program startup. Some performance features may not "
                           "be enabled.")
        logging.getLogger("transformers").warning("PyTorch was not found. Models won't be available and only "
                                                  "tokenizers, configuration and file/data utilities can be used.")
    assert [record.getMessage() for record in caplog.records] == [
        "Collective ops is not configured at program startup. Some performance features may not be enabled."]


def test_known_python_warnings_are_ignored_and_others_raised(quiet):
    log_policy.quiet_libraries()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        log_policy.quiet_libraries()  # its filters go in front of the default one
        warnings.warn("Could not import graphviz. Rendering graph to the graphical format will not be possible.",
                      UserWarning, stacklevel=1)
        warnings.warn("Something else is deprecated", DeprecationWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["Something else is deprecated"]


NO_DRIVER = "I0000 00:00:1796300659.250845   31166 cudart_stub.cc:31] Could not find cuda drivers on your machine"
CUINIT = "E0000 00:00:1796300662.610045   31166 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)"
# TensorFlow 2.21's import on a oneDNN / AVX-512 CPU (a 2-core Xeon with AVX512_BF16), as a worker prints them.
ONEDNN = ("I0000 00:00:1796419366.251757   31710 port.cc:153] oneDNN custom operations are on. You may see slightly "
          "different numerical results due to floating-point round-off errors from different computation orders. To "
          "turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.")
CPU_GUARD = ("I0000 00:00:1796419366.440530   31710 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to "
             "use available CPU instructions in performance-critical operations.")
CPU_GUARD_INSTRUCTIONS = ("To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 AMX_TILE "
                          "AMX_INT8 AMX_BF16 FMA, in other operations, rebuild TensorFlow with the appropriate "
                          "compiler flags.")


@pytest.mark.parametrize(("line", "use_gpu", "noise"), [
    ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", False, True),
    (NO_DRIVER, True, True),
    (CUINIT, False, True),
    (CUINIT, True, False),  # with GPUs asked for, a failed CUDA probe is the first clue to a broken driver
    (ONEDNN, False, True),
    (ONEDNN, True, True),
    (CPU_GUARD, False, True),
    (CPU_GUARD_INSTRUCTIONS, True, True),  # the notice's second line, which has no prefix of its own
    ("I0000 00:00:1796419366.440530   31710 port.cc:153] oneDNN failed to create a primitive", False, False),
    ("To enable the following instructions: AVX2 FMA, rebuild TensorFlow", False, False),  # not the notice
    ("E0000 00:00:1796300662.610045   31166 collective_ops.cc:12] Collective ops is aborted by: rank 1 is gone",
     False, False),
    ("2026-12-03 12:24:22,707 rank0 INFO trainer.train: rank 0 of 1 joined", False, False),
])
def test_native_noise_lines(monkeypatch, line, use_gpu, noise):
    monkeypatch.delenv(log_policy.VERBOSE_ENV, raising=False)
    assert log_policy.is_native_noise(line, use_gpu=use_gpu) is noise


def test_verbose_keeps_everything(monkeypatch, quiet, caplog):
    monkeypatch.setenv(log_policy.VERBOSE_ENV, "1")
    logging.getLogger("paramiko").setLevel(logging.NOTSET)
    log_policy.quiet_libraries()
    with caplog.at_level(logging.INFO):
        logging.getLogger("paramiko.transport").info("Connected (version 2.0, client OpenSSH_9.6)")
    assert caplog.records and not log_policy.is_native_noise(
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", use_gpu=False)
    assert not any(log_policy.is_native_noise(line, use_gpu=False)
                   for line in (ONEDNN, CPU_GUARD, CPU_GUARD_INSTRUCTIONS))
