"""The group's verdict, for the chief: which ranks answered, version and code skew, why collectives failed, and
the one-screen summary with the figures Airflow's metrics carry."""

from __future__ import annotations

import hashlib
import json
import socket
from typing import Any

from core import storage
from core.layout import PreflightOutput
from launcher.host_probe import VERSIONED_PACKAGES
from trainer import runtime

EXIT_CHECKS_FAILED = 1
EXIT_COLLECTIVES_FAILED = 3


def group_id(identity: runtime.WorkerIdentity) -> str:
    """Same for every rank of one launch attempt (its addresses), different for the next attempt."""
    return hashlib.sha256(json.dumps(identity.addresses).encode()).hexdigest()[:16]


def read_rank_reports(output: str, identity: runtime.WorkerIdentity) -> dict[int, dict[str, Any]]:
    reports = {}
    for rank in range(identity.num_workers):
        try:
            report = storage.read_json(PreflightOutput(output).rank_report(rank))
        except (FileNotFoundError, ValueError):
            continue
        if report.get("group_id") == group_id(identity):
            reports[rank] = report
    return reports


def probe_address(address: str, timeout_s: float = 2.0) -> str:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return "reachable"
    except ConnectionRefusedError:
        return "connection refused (nothing listens on that port: the worker is not running or the port is wrong)"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s (host down, wrong address or a firewall)"
    except OSError as error:
        return f"unreachable ({error})"


def version_skew(reports: dict[int, dict[str, Any]]) -> list[str]:
    errors = []
    for package in ("python", *VERSIONED_PACKAGES):
        by_version: dict[str, list[int]] = {}
        for rank, report in sorted(reports.items()):
            by_version.setdefault(report["versions"].get(package) or "missing", []).append(rank)
        if len(by_version) > 1:
            spread = "; ".join(f"{version} on rank(s) {ranks}" for version, ranks in by_version.items())
            errors.append(f"version skew in {package}: {spread}. Install the same environment on every worker "
                          "(uv sync --frozen from the same uv.lock)")
    by_code: dict[str, list[int]] = {}
    for rank, report in sorted(reports.items()):
        by_code.setdefault(report.get("code", {}).get("fingerprint", "unknown"), []).append(rank)
    if len(by_code) > 1:
        copies = [reports[ranks[0]].get("code", {}).get("files", {}) for ranks in by_code.values()]
        differ = sorted({name for files in copies for name in files if len({c.get(name) for c in copies}) > 1})
        named = ", ".join(differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
        hosts = {fingerprint: ", ".join(sorted({reports[r]["host"] for r in ranks}))
                 for fingerprint, ranks in by_code.items()}
        spread = "; ".join(f"{fingerprint} on rank(s) {ranks} ({hosts[fingerprint]})"
                           for fingerprint, ranks in by_code.items())
        errors.append(f"the project's code differs between workers: {spread}; files that differ: {named or 'unknown'}. "
                      "Deploy the same checkout of this project on every host (in remote_python's environment "
                      "there) or the same trainer image")
    return errors


def collective_failure_message(phase: str, error: str, identity: runtime.WorkerIdentity,
                               reports: dict[int, dict[str, Any]], timeout_s: float) -> tuple[str, dict[int, str]]:
    answered = sorted(reports)
    missing = [r for r in range(identity.num_workers) if r not in reports]
    probes = {r: probe_address(identity.addresses[r]) for r in range(identity.num_workers) if r != identity.rank}
    lines = [f"collectives failed during {phase} (collective_timeout_s={timeout_s:g}): {error}",
             f"ranks that answered: {answered or 'none'}; ranks that did not: {missing or 'none'}"]
    lines += [f"rank {r} at {identity.addresses[r]}: {state}" for r, state in sorted(probes.items())]
    lines.append("Check: the address and port of each worker in TF_CONFIG, firewalls between hosts, that every "
                 "worker started (see the launcher's log for ranks that never came up), matching versions, and "
                 "the GPU count. Raise collective_timeout_s only if workers are slow to start.")
    return "\n".join(lines), probes


def port_lines(result: dict[str, Any]) -> list[str]:
    """One line per worker: where its unauthenticated TF port answers."""
    lines = []
    for report in result["workers"]:
        exposure = report.get("worker_port")
        if not exposure:
            continue
        where = f"rank {report['rank']} on {report['host']}: worker port {exposure['port']}"
        if exposure["exposed"]:
            lines.append(f"WARNING: {where} answers on non-loopback {', '.join(exposure['reachable_on'])}: "
                         "anyone who can reach it can run code as this user; keep worker ports private "
                         "(docs/security.md)")
        else:
            lines.append(f"{where}: not reachable on non-loopback addresses "
                         f"({', '.join(exposure['checked']) or 'none on this host'})")
    return lines


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"PREFLIGHT {result['status'].upper()}: {result['num_workers']} worker(s), {result['wall_time_s']:.1f} s",
             (f"{'rank':<5}{'host':<16}{'python':<9}{'tensorflow':<12}{'safetensors':<12}{'transformers':<14}"
              f"{'gpus':<14}{'disk free':>11}  manifest storage")]
    for report in result["workers"]:
        versions = {package: version or "missing" for package, version in report["versions"].items()}
        gpus = report["devices"]["gpus"]
        devices = ",".join(f"{g['index']}:{g['memory_free_mb']}MB" for g in gpus) or "cpu"
        lines.append(f"{report['rank']:<5}{report['host'][:15]:<16}{versions['python']:<9}{versions['tensorflow']:<12}"
                     f"{versions['safetensors']:<12}{versions['transformers']:<14}{devices:<14}"
                     f"{report['disk']['free_bytes'] / 2**30:>8.1f} GiB  "
                     f"{'ok' if report['manifest']['ok'] else 'FAIL':<9}{'ok' if report['storage']['ok'] else 'FAIL'}")
    collectives = result.get("collectives") or {}
    if "all_reduce" in collectives:
        ar, bc = collectives["all_reduce"], collectives["broadcast"]
        lines.append(f"all-reduce: expected {ar['expected']} got {ar['got']} -> {'ok' if ar['ok'] else 'WRONG'}; "
                     f"broadcast from chief -> {'ok' if bc['ok'] else 'WRONG'}")
        bw, lat = collectives["bandwidth"], collectives["latency"]
        lines.append(f"bandwidth: {bw['bytes'] >> 20} MiB all-reduce, median of {bw['iterations']}: "
                     f"{bw['median_s'] * 1e3:.1f} ms, algbw {bw['algbw_gbps']:.3f} GB/s, "
                     f"busbw {bw['busbw_gbps']:.3f} GB/s; latency ({lat['bytes']} B) p50 {lat['p50_ms']:.2f} ms, "
                     f"max {lat['max_ms']:.2f} ms")
    lines += port_lines(result)
    advice = result.get("advisor") or {}
    if advice.get("rows"):
        from trainer.advisor import table_lines

        parameters = advice["inputs"].get("parameters")
        counted = f"{parameters:,} parameters, " if isinstance(parameters, int) else ""
        lines.append(f"scaling advisor (single-worker step from the {advice['inputs']['step_source']}, {counted}"
                     f"gradients {advice['inputs']['gradient_bytes'] / 2**20:.1f} MiB):")
        lines += ["  " + line for line in table_lines(advice)]
    elif advice.get("skipped"):
        lines.append(f"scaling advisor: {advice['skipped']}")
    lines += [f"ERROR: {error}" for error in result["errors"]]
    return lines


def live_values(result: dict[str, Any]) -> dict[str, float]:
    """The figures of a preflight that Airflow's metrics carry (tasks/telemetry.py, scope "preflight")."""
    collectives = result.get("collectives") or {}
    values = {}
    if "bandwidth" in collectives:
        values["busbw_gbps"] = collectives["bandwidth"]["busbw_gbps"]
    if "latency" in collectives:
        values["latency_p50_ms"] = collectives["latency"]["p50_ms"]
    rows = {row["num_workers"]: row for row in (result.get("advisor") or {}).get("rows") or ()}
    row = rows.get(result["num_workers"])
    if row:
        values.update(predicted_speedup=row["speedup"], predicted_efficiency=row["efficiency"],
                      predicted_tokens_per_s=row["tokens_per_s"])
    return values
