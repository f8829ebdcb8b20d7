"""The release task: end everything this run started, prove it is gone and its GPUs are free, write release.json.

Runs as a teardown whatever happened upstream (success, failure, a killed task), and is idempotent. Each backend
ends what is left of the run wherever it runs workers (`Backend.release`): this host first and always (every local
process of the run carries `TFMW_RUN_KEY=<run key>`, so even one whose record was never written, or a grandchild,
is found), then the run's other backends (every SSH host of the run, found by the same marker there), from the
run-state records the operator wrote (`runs/<key>/state/*.json`) and the run's settings. A host that cannot be
reached fails the task, named. A local group launched from another host or container (its record names the
launcher's `launcher.host_identity`) cannot be checked from here: it is reported unverified, never clean, naming
both hosts and the setting that routes release to the GPU hosts (`gpu_queue`). The outcome goes to `release.json`
beside the run's report (with the GPU-time ledger when the run has a report); then release renders report.md from
the three parts (report.json, promotion.json, release.json: "Released: yes/no" beside the gates). It is report.md's
one writer because it runs last, whatever happened upstream; the run's page reads the parts itself.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from core.clock import utc_now
from core.config import AccessPolicy, ConfigError, RunConfig
from core.config.access import STORAGE_ROOT_ENV
from core.config.schema import flat_settings
from core.layout import RunLayout, StorageLayout, absolute_root, run_key
from core.protocol import BACKEND_NAMES, RUN_KEY_ENV
from core.storage import join, list_dir, read_json, write_bytes_atomic, write_json_atomic
from launcher.backend import RELEASE_GRACE_S, BackendFactory, HostRelease, ReleaseResult
from launcher.host_identity import describe, host_identity, same_host
from launcher.process import processes_with_env
from launcher.state_record import StateRecord
from tasks import telemetry
from tasks.connections import uses_run_storage
from tasks.ledger.record import USAGE_CHART, attach_usage, unannounced
from tasks.ledger.summary import UsageSummary
from tasks.report import store as reports
from tasks.report.document import ReportError, RunReport
from tasks.report.parts import UNREADABLE, read_part

log = logging.getLogger("gpt_finetune.release")


class ReleaseError(RuntimeError):
    """Something of this run is still alive or still holds a GPU after release, or a host could not be checked."""


def _run_config(params: Mapping[str, Any]) -> RunConfig:
    """The run's config even when its settings were invalid (release must still run): then the defaults with its
    root when the access policy allows that root, else with the deployment's default root. Read from the params,
    checked as prepare checks them: prepare may have failed before it saved a config."""
    policy = AccessPolicy.from_env()
    try:
        return RunConfig.from_params(dict(params), policy)
    except ConfigError as refused:
        root = params.get("storage_root")
        try:
            policy.check("storage_root", root, hub_ids=False)
            cfg = RunConfig.of(storage_root=root)  # where prepare would have written
        except (ConfigError, TypeError):
            cfg = RunConfig.of(storage_root=os.environ.get(STORAGE_ROOT_ENV, "").strip() or RunConfig().storage_root)
        log.warning("The run's settings are refused (%s): release uses the defaults with storage_root %r.", refused,
                    cfg.storage_root)
        return cfg


def processes_of_run(key: str) -> dict[int, str]:
    """pid -> command line of every live process on this host whose environment carries this run's key."""
    return processes_with_env({RUN_KEY_ENV: key})


def _state_records(state_url: str) -> tuple[list[str], dict[str, StateRecord], dict[str, str]]:
    """The run-state records' names, the records that are one by name (of a backend this project has), and why each
    other could not be read: release cannot vouch for what such a record named."""
    names, records, unreadable = [], {}, {}
    for name in list_dir(state_url):
        if not name.endswith(".json"):
            continue
        names.append(name)
        url = f"{state_url}/{name}"
        try:
            records[name] = _record(read_json(url), url)
        except (ValueError, TypeError) as error:
            log.warning("State record %s is malformed (%s): skipped; the process scan still covers this host.", url,
                        error)
            unreadable[name] = str(error)
    return names, records, unreadable


def _record(document: Any, where: str) -> StateRecord:
    record = StateRecord.from_json(document, where)
    if record.backend not in BACKEND_NAMES:  # release builds each backend a record names
        raise ValueError(f"{where}: backend: {record.backend!r} is none of {', '.join(BACKEND_NAMES)}")
    return record


def cross_checked(named: dict[str, StateRecord], unreadable: dict[str, str],
                  pushed: Mapping[str, Any]) -> tuple[dict[str, StateRecord], list[dict[str, Any]]]:
    """The records release acts on, and an unverified entry for each it cannot vouch for: a stored record that is
    unreadable, and one the operator pushed to XCom (`pushed`: task id -> record) that storage lacks or holds
    otherwise (another backend, host, work directory or workers). The XCom copy is acted on too."""
    records, entries = dict(named), []
    for task_id, document in sorted(pushed.items()):
        if document is None:
            continue
        name = f"{task_id}.json"
        try:
            copy = _record(document, f"XCom {task_id}.worker_state")
        except (ValueError, TypeError) as error:
            entries.append(_unverified(name, f"the copy the operator pushed to XCom is malformed ({error})"))
            continue
        stored = named.get(name)
        if name in unreadable:
            records[name] = copy
        elif stored is None:
            records[name] = copy
            entries.append(_unverified(name, "is missing from storage, though the operator pushed it to XCom: "
                                             "it was deleted; release acted on the XCom copy"))
        elif _identity(stored) != _identity(copy):
            records[f"{task_id}.xcom.json"] = copy
            entries.append(_unverified(name, "differs from the copy the operator pushed to XCom (backend, host, "
                                             "work directory or workers): it was rewritten; release acted on both"))
    entries += [_unverified(name, f"cannot be read ({why})") for name, why in sorted(unreadable.items())]
    return records, entries


def _identity(record: StateRecord) -> tuple[Any, ...]:
    """What a record says about where the group ran; its state and times move on after the XCom push."""
    return (record.task_id, record.backend, record.workdir, record.launcher,
            [(w.rank, w.host, w.port, dict(w.extra)) for w in record.workers])


def _unverified(name: str, why: str) -> dict[str, Any]:
    return {"backend": "unknown", "host": "unknown", "state_record": name, "found": [], "terminated": [],
            "killed": [], "survivors": [],
            "unverified": (f"state record {name} {why}. Whatever group it named may still hold hosts or GPUs that "
                           "release could not check from it: check the run's hosts (its workers carry TFMW_RUN_KEY), "
                           "find who can write the storage root, and clear the release task.")}


def unverified_elsewhere(records: Mapping[str, StateRecord], here: Mapping[str, str]) -> list[dict[str, Any]]:
    """A host entry for each local group whose launcher ran on another host or container than `here`: this host
    cannot see its processes, work directory or GPUs, so nothing of it is checked, and the entry says so."""
    entries = []
    for name, record in sorted(records.items()):
        if record.backend != "local" or same_host(record.launcher, here):
            continue
        launcher = record.launcher
        entries.append({
            "backend": "local", "host": launcher.get("hostname") or "unknown", "state_record": name,
            "launcher": launcher or None, "found": [], "terminated": [], "killed": [], "survivors": [],
            "unverified": (
                f"state record {name} (state {record.state}) is a local group launched on "
                f"{describe(launcher)}, but release runs on {describe(here)}, which cannot see that host's "
                f"processes, work directory or GPUs: nothing of it was checked. Release must run where the group "
                f"ran: set gpu_queue (default GPT_FINETUNE_GPU_QUEUE) to a Celery queue that only that host's "
                f"worker serves (`airflow celery worker -q <gpu_queue>` on it); release follows the GPU tasks "
                f"there. Then check that host (its workers carry TFMW_RUN_KEY) and clear the release task."),
        })
    return entries


def _describe(hosts: list[dict[str, Any]]) -> str:
    parts = []
    for host in hosts:
        cmdlines = {p["pid"]: p["cmdline"] for p in host.get("found", []) if isinstance(p, dict)}
        # Survivors are pids, or objects such as "pod/<name>" on a cluster.
        parts += [f"{'pid ' if isinstance(pid, int) else ''}{pid} on {host['host']}"
                  + (f" ({cmdlines[pid][:80]})" if pid in cmdlines else "") for pid in host.get("survivors", [])]
        if host.get("error"):
            parts.append(f"host {host['host']} not checked: {host['error']}")
        parts += host.get("problems", [])
    return ", ".join(parts) or "none"


@uses_run_storage
def release_run(params: Mapping[str, Any], run_id: str, dag_id: str, make_backend: BackendFactory,
                grace_period_s: float = RELEASE_GRACE_S, pushed: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`pushed`: the state records the worker-group operators pushed to XCom, by task id (`STATE_XCOM_KEY`)."""
    key = run_key(dag_id, run_id)
    cfg = _run_config(params)
    run = StorageLayout(absolute_root(cfg.storage_root)).run(key)
    try:
        names, stored, unreadable = _state_records(run.state)
        storage_error = None
    except Exception as error:  # noqa: BLE001 - raised below, once this host's processes have ended
        names, stored, unreadable, storage_error = [], {}, {}, error
    named, doubtful = cross_checked(stored, unreadable, pushed or {})
    identity = host_identity()
    elsewhere = unverified_elsewhere(named, identity)
    foreign = {entry["state_record"] for entry in elsewhere}
    elsewhere += doubtful
    # Another host's pids and work directories mean nothing here: only this host's records reach the backends.
    records = [record for name, record in named.items() if name not in foreign]
    # Every backend the run used: this host's always (and first), the run's own, and any a state record names.
    # Each gets every record and takes what is its own (the launcher work directories are all on this host).
    backends = ["local", *sorted({cfg.launch.backend, *(r.backend for r in records)} - {"local"})]
    results: dict[str, ReleaseResult] = {}
    try:
        for name in backends:
            backend = make_backend(cfg, name)
            try:
                results[name] = backend.release(key, records, grace_s=grace_period_s)
            finally:
                backend.close()
            if name == "local":
                log.info("Release of run %s on %s: %d live process(es)", key, results[name].hosts[0].host,
                         len(results[name].hosts[0].found))
        if storage_error is not None:
            raise storage_error
        result = _release_record(key, names, results, identity, elsewhere)
        write_release(run, result, dag_id)
    except Exception as error:
        here = results["local"].hosts[0].entry() if "local" in results else HostRelease(socket.gethostname()).entry()
        raise ReleaseError(
            f"Release of run {key} on {here['host']} could not be recorded: {type(error).__name__}: {error}. "
            f"Processes ended here: {len(here['terminated'])} terminated, {len(here['killed'])} killed; still "
            f"alive: {_describe([here])}. Fix access to the storage root (storage_root / storage_conn_id) or "
            f"the hosts, and clear the release task; until it succeeds this run counts as not released."
        ) from error
    for host in (host for host in result["hosts"] if not host.get("unverified")):
        log.info("Release of run %s on %s: terminated %s, killed %s, survivors %s; GPUs: %s%s", key, host["host"],
                 host.get("terminated"), host.get("killed"), host.get("survivors"),
                 (host.get("gpu_check") or {}).get("note") or (host.get("gpu_check") or {}).get("devices"),
                 f"; ERROR: {host['error']}" if host.get("error") else "")
    for entry in elsewhere:
        log.warning("Release of run %s: UNVERIFIED: %s", key, entry["unverified"])
    log.info("Release record written to %s", run.release)
    telemetry.emit_task_metrics("release", {
        "clean": result["clean"], "processes_found": len(result["processes_found"]),
        "terminated": len(result["terminated"]), "killed": len(result["killed"])}, run=key)
    if not result["clean"]:
        raise ReleaseError(f"Run {key} is not fully released: " + _not_released(result["hosts"], elsewhere))
    return {"release_url": run.release, **{k: result[k] for k in ("clean", "terminated", "killed")}}


def _not_released(hosts: list[dict[str, Any]], elsewhere: list[dict[str, Any]]) -> str:
    """What kept release from proving the run released, and what to do about it."""
    alive = _describe(hosts)
    held = [h for host in hosts for h in (host.get("gpu_check") or {}).get("held_by_run", [])]
    parts = [f"Unverified: {entry['unverified']}" for entry in elsewhere]
    gpus = [f"{host['host']} GPU {gpu['gpu'] if gpu['gpu'] is not None else '(gone)'} ({gpu['uuid'] or 'no UUID'}): "
            f"{gpu['reason']}" for host in hosts for gpu in (host.get("gpu_check") or {}).get("unverified", [])]
    if gpus:
        parts.append(f"GPUs not verified free: {'; '.join(gpus)}. Check them on that host (nvidia-smi), then clear "
                     "the release task.")
    if alive != "none" or held or not parts:
        parts.insert(0, f"still alive: {alive}; GPU holders: {held or 'none'}. End them by hand (kill -9 <pid> on "
                        f"that host), make the host reachable, and clear the release task.")
    return " ".join(parts)


def _release_record(key: str, names: list[str], results: dict[str, ReleaseResult], identity: dict[str, str],
                    elsewhere: list[dict[str, Any]]) -> dict[str, Any]:
    """release.json: every host of every backend (`HostRelease.entry`), and the local groups of other hosts
    (unverified); the top-level process fields are this host's."""
    here = results["local"].hosts[0].entry()
    hosts = [{"backend": name, **host.entry()} for name, result in results.items() for host in result.hosts]
    return {
        "run_key": key,
        "host": here["host"],
        "host_identity": identity,
        "released_at": utc_now(),
        "state_records": names,
        "processes_found": here["found"],
        "terminated": here["terminated"],
        "killed": here["killed"],
        "survivors": here["survivors"],
        "removed_dirs": here["removed_dirs"],
        "gpu_check": here["gpu_check"],
        "hosts": hosts + elsewhere,
        "unverified_records": [entry["state_record"] for entry in elsewhere],
        "clean": all(result.clean for result in results.values()) and not elsewhere,
    }


def _evaluated(run: RunLayout) -> RunReport | None:
    """The run's report.json; None (logged) when there is none, or none that reads as a report: it is untrusted, and
    release must not fail on it."""
    part = read_part(run.report_json)
    if part is None or UNREADABLE in part:
        return None
    try:
        return RunReport.from_json(part, run.report_json)
    except ReportError as error:
        log.warning("No GPU-time ledger in release.json: %s", error)
        return None


def write_release(run: RunLayout, release: dict[str, Any], dag_id: str | None = None) -> None:
    """release.json beside the run's report (its one writer), with the GPU-time ledger up to this release when
    evaluate wrote a report (`usage`, its chart beside it), then report.md from the three parts (its one writer too;
    none without report.json); with `dag_id`, the GPU tasks' admission waits are read from Airflow
    (tasks/ledger/airflow_api.py)."""
    report = _evaluated(run)
    charts: dict[str, bytes] = {}
    if report is not None:
        summary, charts = attach_usage(run.report, report, release["released_at"], dag_id)
        if summary is not None:
            release = {**release, "usage": summary.to_xcom(), "charts": {"usage": USAGE_CHART}}
            announce_usage(summary, report)
    for name, png in charts.items():
        write_bytes_atomic(join(run.report, name), png)
    write_json_atomic(run.release, release)
    reports.render_report_md(run.report)


def announce_usage(summary: UsageSummary, report: RunReport) -> None:
    """The ledger's gauges once, at release, and its warnings not raised live counted and mailed; best effort: the
    ledger is a view of the run, and release's proof must not depend on it."""
    warnings = unannounced(summary)
    try:
        _emit_usage(summary, warnings, report.run_key)
        _mail_usage(report, warnings)
    except Exception:
        log.exception("could not send the GPU-time ledger's metrics or warnings of %s", report.run_key)


def _emit_usage(summary: UsageSummary, warnings: list[str], run_key: str) -> None:
    """The ledger's gauges and a `cost_warning` count per warning."""
    cost, price = summary.cost, summary.price
    telemetry.emit_task_metrics("usage", {
        "held_gpu_h": summary.held_gpu_h, "busy_gpu_h": summary.busy_gpu_h, "idle_gpu_h": summary.idle_gpu_h,
        "busy_share": summary.busy_share, "time_to_release_s": summary.time_to_release_s,
        "cost": cost.held if cost else None, "cost_per_mtoken": cost.per_mtoken if cost else None,
        "price_per_gpu_h": price.rate if price else None,
        **{f"idle_{cause}_gpu_h": hours for cause, hours in summary.idle_by_cause_gpu_h.items()}}, run=run_key)
    for _ in warnings:
        telemetry.count("cost_warning", {"run": run_key, "task": "release"})


def _mail_usage(report: RunReport, warnings: list[str]) -> None:
    """The warnings as one alert, when the run has an alert connection (bounded like every alert)."""
    cfg = flat_settings(report.config)
    if not warnings or not cfg.get("alert_conn_id"):
        return
    from tasks.alerts import run_page_url, send_alert

    run_id = report.run_id
    opening = f"The GPU time of run {run_id} needs a look (the run itself is not failed by it):"
    text = "\n".join([opening, "", *(f"- {warning}" for warning in warnings), "", f"Report: {run_page_url(run_id)}"])
    send_alert(cfg["alert_conn_id"], tuple(cfg.get("alert_emails") or ()), f"[gpt_finetune] run {run_id}: GPU time "
               "warnings", text, run=report.run_key, task="release")
