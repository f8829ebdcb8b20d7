"""trainer/preflight/verdict.py: skew across ranks, and the figures Airflow's metrics carry."""

from __future__ import annotations

from trainer import host_info
from trainer.preflight import verdict


def test_version_skew_names_package_versions_and_ranks():
    reports = {r: {"versions": {"python": "3.11.7", "tensorflow": v, "safetensors": "0.7.0", "transformers": "4.57.6",
                                "numpy": "2.1"}} for r, v in enumerate(["2.21.0", "2.20.0", "2.21.0"])}
    assert verdict.version_skew(reports) == [
        ("version skew in tensorflow: 2.21.0 on rank(s) [0, 2]; 2.20.0 on rank(s) [1]. Install the same environment "
         "on every worker (uv sync --frozen from the same uv.lock)")]
    assert verdict.version_skew({0: reports[0], 2: reports[2]}) == []


def test_a_host_with_another_copy_of_the_project_code_is_named_with_the_files_that_differ():
    here = host_info.code_fingerprint()
    # Another copy whose data.py differs (how host_info fingerprints a copy: tests/trainer/test_host_info.py).
    there = {"fingerprint": "0123456789abcdef", "files": {**here["files"], "trainer/data.py": "a different hash"}}
    versions = {"python": "3.11.7", "tensorflow": "2.21.0", "safetensors": "0.7.0", "transformers": "4.57.6",
                "numpy": "2.1"}
    reports = {0: {"host": "host-a", "versions": versions, "code": here},
               1: {"host": "host-a", "versions": versions, "code": here},
               2: {"host": "host-c", "versions": versions, "code": there}}
    assert verdict.version_skew(reports) == [(
        f"the project's code differs between workers: {here['fingerprint']} on rank(s) [0, 1] (host-a); "
        f"{there['fingerprint']} on rank(s) [2] (host-c); files that differ: trainer/data.py. Deploy the same checkout "
        "of this project on every host (in remote_python's environment there) or the same trainer image")]
    assert verdict.version_skew({0: reports[0], 1: reports[1]}) == []


def test_live_values_carry_bandwidth_latency_and_the_advisors_row_for_the_asked_workers():
    result = {"num_workers": 2,
              "collectives": {"bandwidth": {"busbw_gbps": 0.5}, "latency": {"p50_ms": 0.3}},
              "advisor": {"rows": [{"num_workers": n, "speedup": s, "efficiency": s / n, "tokens_per_s": 1000 * s}
                                   for n, s in ((1, 1.0), (2, 1.5))]}}
    assert verdict.live_values(result) == {"busbw_gbps": 0.5, "latency_p50_ms": 0.3, "predicted_speedup": 1.5,
                                            "predicted_efficiency": 0.75, "predicted_tokens_per_s": 1500.0}
    assert verdict.live_values({"num_workers": 1, "collectives": None}) == {}
