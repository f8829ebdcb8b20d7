"""SSH backend: each rank runs under a small agent (`launcher.agent`) on a remote host.

One SSH connection per host (paramiko, made by the Airflow side from an SSH connection with host-key checking;
launcher/ssh_agents.py asks the agents), one session channel per rank (launcher/ssh_worker.py): `exec
<remote_python> -u -m launcher.agent run`, then the rank's command, environment and secrets as one JSON line on the
agent's stdin, never in an argv or an exec string. The agent starts the worker in its own process group, relays its
output, and ends the whole group (TERM, grace, KILL) when its stdin closes: `terminate` writes the stop line and
closes our end of the channel (the group's grace period applies); a dropped connection, or this process dying
however it dies (the kernel closes its sockets), closes it too, and the agent then ends the group with the short
orphan grace.

Placement asks the hosts' agents (`probe`), all at once, for free ports on every interface and free GPUs. Each host
offers `num_workers` ports, so one given to an earlier host can be skipped (TensorFlow binds 0.0.0.0 and loopback
"hosts" share one kernel); TF_CONFIG names each host by the address its peers reach it at (`RemoteHost.address`),
never localhost. No filesystem is shared: the workers read shards and write results through object storage, and each
host keeps its own shard cache.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from core.document import DocumentError
from launcher.backend import RELEASE_GRACE_S, Backend, Capacity, HostRelease, ReleaseResult
from launcher.errors import InsufficientGPUsError, LaunchError
from launcher.gpu_memory import idle_levels_mb
from launcher.gpus import GPU_RELEASE_WAIT_S
from launcher.process import ORPHAN_GRACE_S
from launcher.spec import GroupSpec, Placement, WorkerOutcome, WorkerSpec
from launcher.ssh_agents import MAX_PARALLEL_REQUESTS, REQUEST_TIMEOUT_S, AgentClient, HostError, RemoteHost
from launcher.ssh_worker import SSHWorkerHandle
from launcher.state_record import StateRecord

log = logging.getLogger(__name__)

# Right after this backend stopped workers, a probe that finds too few free GPUs is repeated this often, up to
# GPU_RELEASE_WAIT_S: NVML lists a stopped rank for 0.09-0.12 s after it died, and the agents keep no state between
# requests to wait on (a probe is one SSH request per host, so not as often as the local backend polls).
GPU_SETTLE_POLL_S = 0.25
UTILIZATION_TIMEOUT_S = 10.0  # one idle-held sample (its own thread: a slow host only delays that sample)


class SSHBackend(AgentClient, Backend):
    name: ClassVar[str] = "ssh"

    def __init__(self, hosts: Sequence[RemoteHost], *, remote_python: str, remote_workdir: str,
                 workers_per_host: int = 0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not hosts:
            raise LaunchError("the ssh backend needs at least one host: set ssh_conn_ids")
        AgentClient.__init__(self, remote_python)
        self.hosts = list(hosts)
        self.remote_workdir = remote_workdir
        self.workers_per_host = workers_per_host
        self.clock, self.sleep = clock, sleep
        self._gpus_settle_until = 0.0  # until then too few free GPUs are probed again (see GPU_SETTLE_POLL_S)

    # -- placing and starting -----------------------------------------------------------------------------------

    def slots(self, probe: dict[str, Any], use_gpu: bool) -> int:
        """Workers one host takes: `workers_per_host`, else one per free GPU with `use_gpu`, else one; never more
        than its free GPUs with `use_gpu`."""
        slots = self.workers_per_host or (len(probe["free_gpus"]) if use_gpu else 1)
        return min(slots, len(probe["free_gpus"])) if use_gpu else slots

    def capacity(self, group: GroupSpec) -> Capacity:
        """Every host probed at once; one that is unreachable or has no free GPU is left out, and from now on this
        backend places only on the hosts that answered (in their order)."""
        usable, workers, reasons = [], 0, []
        payload = {"ports": 0, "workdir": self.remote_workdir, "use_gpu": group.use_gpu}
        for host, probe in zip(self.hosts, self._probe(self.hosts, payload, group.num_workers), strict=True):
            if isinstance(probe, LaunchError):
                log.warning("leaving host %s out of this launch: %s", host, probe)
                reasons.append(f"host {host.address} unreachable")
                continue
            slots = self.slots(probe, group.use_gpu)
            if not slots:
                reasons.append(f"host {host.address} has no free GPU{_gpu_detail(probe)}")
                continue
            usable.append(host)
            workers += slots
        narrowed = len(usable) < len(self.hosts)
        self.hosts = usable
        return Capacity(workers, tuple(reasons), {"ssh_conn_ids": [h.conn_id for h in usable]} if narrowed else {},
                        tuple(h.address for h in usable))

    def place(self, group: GroupSpec) -> list[Placement]:
        placements: list[Placement] = []
        capacity: list[str] = []
        versions: dict[str, str] = {}
        # Hosts are probed in waves of as many as the workers still to place could need; within a wave all at once.
        # A failed probe fails placement only when that host's turn comes while workers are still unplaced.
        waiting = list(self.hosts)
        while waiting and len(placements) < group.num_workers:
            need = group.num_workers - len(placements)
            hosts_needed = -(-need // (self.workers_per_host or 1))  # at least one worker per usable host
            wave, waiting = waiting[:hosts_needed], waiting[hosts_needed:]
            payload = {"ports": group.num_workers, "workdir": self.remote_workdir, "use_gpu": group.use_gpu}
            for host, probe in zip(wave, self._probe(wave, payload, need), strict=True):
                need = group.num_workers - len(placements)
                if need <= 0:
                    break
                if isinstance(probe, HostError):
                    raise probe
                self._place_on(host, probe, group, need, placements, capacity, versions)
        for host, line in versions.items():
            log.info("host %s: %s", host, line)
        if len(placements) < group.num_workers:
            error = InsufficientGPUsError if group.use_gpu else LaunchError
            raise error(
                f"num_workers={group.num_workers} but the hosts take only {len(placements)} worker(s): "
                f"{'; '.join(capacity)}. Add hosts to ssh_conn_ids, raise workers_per_host"
                f"{', free GPUs' if group.use_gpu else ''}, or lower num_workers.")
        return placements

    def _probe(self, hosts: Sequence[RemoteHost], payload: Mapping[str, Any],
               wanted: int) -> list[dict[str, Any] | HostError]:
        """The hosts' probes; with `use_gpu`, repeated while they have fewer than `wanted` free GPUs in all, up to
        GPU_RELEASE_WAIT_S after this backend stopped workers (review section 5: a relaunch probed GPUs its stopped
        ranks still held)."""
        while True:
            answers = self.ask_all(hosts, "probe", payload)
            free = sum(len(answer["free_gpus"]) for answer in answers if not isinstance(answer, LaunchError))
            if not payload["use_gpu"] or free >= wanted or self.clock() >= self._gpus_settle_until:
                return answers
            self.sleep(GPU_SETTLE_POLL_S)

    def _place_on(self, host: RemoteHost, probe: dict[str, Any], group: GroupSpec, need: int,
                  placements: list[Placement], capacity: list[str], versions: dict[str, str]) -> None:
        """Give up to `need` workers to `host`, each on a port that no earlier host took."""
        if not probe.get("workdir_writable"):
            raise HostError(f"host {host}: remote_workdir {probe.get('workdir')} is not writable "
                            f"({probe.get('workdir_error')}): set remote_workdir to a directory the SSH user "
                            "may write.")
        versions[str(host)] = ", ".join(f"{k} {v}" for k, v in probe["versions"].items())
        gpus = probe["free_gpus"]
        slots = self.slots(probe, group.use_gpu)
        capacity.append(f"{host}: {slots}" + (f" (free GPUs {gpus}{_gpu_detail(probe)})" if group.use_gpu else ""))
        taken = {placement.port for placement in placements}
        ports = [port for port in probe["free_ports"] if port not in taken]
        idle = idle_levels_mb((probe.get("gpus") or {}).get("idle_mb")) if group.use_gpu else {}
        for slot in range(min(slots, need)):
            pin = (gpus[slot],) if group.use_gpu else ()
            levels = {str(gpu): idle[str(gpu)] for gpu in pin if str(gpu) in idle}
            placements.append(Placement(host.address, ports[slot], pin, {"conn_id": host.conn_id}, levels))

    def command(self, group: GroupSpec) -> list[str]:
        return [self.remote_python, "-u", "-m", group.entrypoint, *group.args]

    def start(self, group: GroupSpec, worker: WorkerSpec, command: list[str],
              env: Mapping[str, str]) -> SSHWorkerHandle:
        host = next(h for h in self.hosts if h.conn_id == worker.placement.where["conn_id"])
        channel = self._open(host, "run")
        request = {
            "argv": command,
            "env": {**env, **group.secret_env},  # secrets travel on stdin only
            "cwd": f"{self.remote_workdir}/{group.run_key or 'adhoc'}/{group.name}/rank-{worker.rank}",
            "grace_s": group.grace_period_s,
        }
        channel.sendall(json.dumps(request).encode() + b"\n")
        return SSHWorkerHandle(self, host, worker.rank, channel, group.run_key)

    def end_group(self, group: GroupSpec) -> None:
        self._gpus_settle_until = self.clock() + GPU_RELEASE_WAIT_S  # its ranks were just stopped

    def check_slots_free(self, group: GroupSpec, workers: Sequence[WorkerOutcome]) -> dict[str, Any]:
        """Every host the group ran on, asked at once (the agent's `slots`: release's bounded checks, on that host):
        no process of the group left there and, with GPUs, its pids gone from NVML and its GPUs' memory back. Free
        only when every host proved it; `free_after_s` is the slowest host's."""
        by_conn: dict[str, list[WorkerOutcome]] = {}
        for worker in workers:
            by_conn.setdefault(str(worker.record.get("conn_id")), []).append(worker)
        hosts = [h for h in self.hosts if h.conn_id in by_conn]
        requests = {h.conn_id: {"run_key": group.run_key, "group": group.name, "use_gpu": group.use_gpu,
                                "pids": [w.record["remote_pid"] for w in by_conn[h.conn_id]
                                         if isinstance(w.record.get("remote_pid"), int)],
                                "gpus": [str(d) for w in by_conn[h.conn_id] for d in (w.devices or ())],
                                "idle_mb": {k: v for w in by_conn[h.conn_id] for k, v in w.gpu_idle_mb.items()}}
                    for h in hosts}
        with ThreadPoolExecutor(max(1, min(len(hosts), MAX_PARALLEL_REQUESTS)), thread_name_prefix="ssh-slots") as pool:
            answers = list(pool.map(lambda h: self._ask_slots(h, requests[h.conn_id]), hosts))
        missing = sorted(set(by_conn) - {h.conn_id for h in hosts})
        free = bool(hosts) and not missing and all(a.get("free") is True for a in answers)
        return {"checked": True, "slots": "gpu" if group.use_gpu else "cpu", "free": free,
                "free_after_s": max(a["free_after_s"] for a in answers) if free else None,
                "hosts": answers, **({"note": f"no host of connection(s) {missing} to ask"} if missing else {})}

    def utilization(self, group: GroupSpec, workers: Sequence[WorkerOutcome]) -> dict[int, float | None] | None:
        """Each rank's GPU utilization from its host's agent (`utilization`, every host at once); a host that does
        not answer gives no sample (None), which counts as busy. None on a CPU run."""
        if not group.use_gpu:
            return None
        by_conn: dict[str, list[WorkerOutcome]] = {}
        for worker in workers:
            if worker.devices:
                by_conn.setdefault(str(worker.record.get("conn_id")), []).append(worker)
        hosts = [h for h in self.hosts if h.conn_id in by_conn]
        answers = self.ask_all(hosts, "utilization", lambda host: {
            "gpus": [str(w.devices[0]) for w in by_conn[host.conn_id]]}, timeout_s=UTILIZATION_TIMEOUT_S)
        found: dict[int, float | None] = {w.rank: None for w in workers}
        for host, answer in zip(hosts, answers, strict=True):
            if not isinstance(answer, HostError):
                found.update(zip((w.rank for w in by_conn[host.conn_id]), answer.get("utilization") or [],
                                 strict=False))
        return found

    def _ask_slots(self, host: RemoteHost, request: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return {**self.request(host, "slots", request, timeout_s=REQUEST_TIMEOUT_S + GPU_RELEASE_WAIT_S),
                    "host": host.address}
        except HostError as error:
            return {"host": host.address, "free": None, "error": str(error)}

    # -- earlier attempts and release ---------------------------------------------------------------------------

    def end_earlier_attempts(self, group: GroupSpec) -> list[HostRelease]:
        """Every host of the settings, asked at once (an earlier attempt may have used hosts this one will not).
        An unreachable host is reported: it cannot be placed on either, so nothing launches beside its workers."""
        request = {"run_key": group.run_key, "group": group.name, "grace_s": min(group.grace_period_s, ORPHAN_GRACE_S)}
        answers = self.ask_all(self.hosts, "reap", request, timeout_s=REQUEST_TIMEOUT_S)
        if any(not isinstance(answer, HostError) and answer.get("found") for answer in answers):
            self._gpus_settle_until = self.clock() + GPU_RELEASE_WAIT_S  # their GPUs may still list them
        return [_host_release(host, answer) for host, answer in zip(self.hosts, answers, strict=True)]

    # -- release ------------------------------------------------------------------------------------------------

    def release(self, run_key: str, records: Sequence[StateRecord], grace_s: float = RELEASE_GRACE_S) -> ReleaseResult:
        """Every host of the run (from the settings, so also one no record names), asked at once: its processes
        ended, its run directory removed, its GPUs checked. An unreachable host is reported, and the release is not
        clean."""
        idle = {host.conn_id: idle_levels_mb({name: mb for r in records for w in r.workers
                                              if w.extra.get("conn_id") == host.conn_id
                                              for name, mb in (w.gpu_idle_mb or {}).items()}) for host in self.hosts}
        answers = self.ask_all(self.hosts, "release", lambda host: {
            "run_key": run_key, "grace_s": grace_s, "workdir": self.remote_workdir, "idle_mb": idle[host.conn_id]},
            timeout_s=grace_s + 30)
        hosts = tuple(_host_release(host, answer) for host, answer in zip(self.hosts, answers, strict=True))
        # The agent's own verdict (its processes gone, its GPUs checked free) for each host that answered.
        return ReleaseResult(self.name, hosts, clean=all(h.evidence.get("clean") is True and not h.error
                                                         for h in hosts))


def _host_release(host: RemoteHost, answer: dict[str, Any] | HostError) -> HostRelease:
    """A host's entry from its agent's answer (checked: a host's answer is untrusted input), or the error that kept
    it from answering; the agent's hostname is kept beside the address the settings name."""
    if isinstance(answer, HostError):
        return HostRelease(host.address, error=str(answer), evidence={"conn_id": host.conn_id})
    try:
        return HostRelease.of(host.address, {**answer, "hostname": answer.get("host"), "conn_id": host.conn_id})
    except DocumentError as error:
        return HostRelease(host.address, error=f"its agent's answer is malformed: {error}",
                           evidence={"conn_id": host.conn_id})


def _gpu_detail(probe: Mapping[str, Any]) -> str:
    """What the host's agent said of its GPUs that are not free: NVML missing, or each GPU left out and why."""
    gpus = probe.get("gpus") or {}
    if gpus.get("unavailable"):
        return f"; NVML unavailable: {gpus['unavailable']}"
    left_out = [f"GPU {entry.get('gpu')} ({entry.get('uuid') or 'no UUID'}): {entry.get('reason')}"
                for entry in gpus.get("left_out") or ()]
    return f"; left out: {'; '.join(left_out)}" if left_out else ""
