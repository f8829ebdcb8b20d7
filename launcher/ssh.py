"""SSH backend: each rank runs under a small agent (`launcher.agent`) on a remote host.

One SSH connection per host (paramiko, made by the Airflow side from an SSH connection with host-key checking),
one session channel per rank: `exec <remote_python> -u -m launcher.agent run`, then the rank's
command, environment and secrets as one JSON line on the agent's stdin, never in an argv or an exec string. The
agent starts the worker in its own process group, relays its output, and ends the whole group (TERM, grace, KILL)
when its stdin closes: `terminate` writes the stop line and closes our end of the channel (the group's grace
period applies); a dropped connection, or this process dying however it dies (the kernel closes its sockets),
closes it too, and the agent then ends the group with the short orphan grace.

Placement asks the hosts' agents (`probe`), all at once, for free ports on every interface and free GPUs. Each
host offers `num_workers` ports, so one given to an earlier host can be skipped (TensorFlow binds 0.0.0.0 and
loopback "hosts" share one kernel); TF_CONFIG names each host by the address its peers reach it at
(`RemoteHost.address`), never localhost. No filesystem is shared: the workers read shards and write results
through object storage, and each host keeps its own shard cache.
"""

from __future__ import annotations

import json
import logging
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, ClassVar

from core.document import DocumentError
from core.protocol import ABORT_LINE, AGENT_LINE, AGENT_MODULE, STOP_LINE, MalformedControlLine, read_control_line
from launcher.backend import RELEASE_GRACE_S, Backend, Capacity, HostRelease, ReleaseResult, WorkerHandle
from launcher.errors import InsufficientGPUsError, LaunchError
from launcher.gpu_memory import idle_levels_mb
from launcher.gpus import GPU_RELEASE_WAIT_S
from launcher.process import ORPHAN_GRACE_S, exit_status_to_code
from launcher.spec import GroupSpec, Placement, WorkerOutcome, WorkerSpec
from launcher.state_record import StateRecord

log = logging.getLogger(__name__)

EXIT_CONNECTION_LOST = 255  # what ssh(1) reports when the connection, not the command, ended
REQUEST_TIMEOUT_S = 30.0
# Right after this backend stopped workers, a probe that finds too few free GPUs is repeated this often, up to
# GPU_RELEASE_WAIT_S: NVML lists a stopped rank for 0.09-0.12 s after it died, and the agents keep no state between
# requests to wait on (a probe is one SSH request per host, so not as often as the local backend polls).
GPU_SETTLE_POLL_S = 0.25
MAX_PARALLEL_REQUESTS = 16  # SSH sessions opened at once when asking every host (probe, release)
KILL_TIMEOUT_S = 3.0  # kill runs inside Airflow's 5 s on_kill budget
UTILIZATION_TIMEOUT_S = 10.0  # one idle-held sample (its own thread: a slow host only delays that sample)


@dataclass(frozen=True)
class RemoteHost:
    """One SSH host: its connection id (for messages and records), the address its peers reach it at (it goes
    into TF_CONFIG), and how to connect (a paramiko `SSHClient` with host keys checked)."""

    conn_id: str
    address: str
    connect: Callable[[], Any]

    def __str__(self) -> str:
        return f"{self.address} (connection {self.conn_id})"


class HostError(LaunchError):
    """A host could not be reached, refused us, or its agent failed; the message names the host and the fix."""


class SSHWorkerHandle(WorkerHandle):
    """A rank behind its agent. The output stream hides the agent's control lines and keeps what they say."""

    def __init__(self, backend: SSHBackend, host: RemoteHost, rank: int, channel: Any, run_key: str) -> None:
        self.backend, self.remote, self.rank, self.channel, self.run_key = backend, host, rank, channel, run_key
        self.host = host.address
        self.pid: int | None = None
        self.pgid: int | None = None
        self.agent: dict[str, Any] = {}
        self.agent_error: str | None = None
        self.malformed_control_lines = 0
        self._stream = channel.makefile("rb")
        self._killed = False

    # -- output -------------------------------------------------------------------------------------------------

    @property
    def output(self) -> IO[bytes]:
        return self  # readline/close below

    def readline(self, size: int = -1) -> bytes:
        while True:
            try:
                line = self._stream.readline(size)
            except (OSError, EOFError):
                return b""
            try:
                control = read_control_line(line)
                if control is not None and control[0] == AGENT_LINE and self.agent:  # stop signals the first's pid
                    raise MalformedControlLine(f"{AGENT_LINE} line after the agent's own: the worker printed it")
            except MalformedControlLine as error:
                self._ignore_control_line(error)
                continue
            if control is None:
                return line
            tag, payload = control
            if tag == AGENT_LINE:
                self.agent = payload
                self.pid, self.pgid = self.agent.get("pid"), self.agent.get("pgid")
                versions = ", ".join(f"{k} {v}" for k, v in (self.agent.get("versions") or {}).items())
                return (f"[agent] {self.agent.get('host')}: pid {self.pid}, python {self.agent.get('python')}, "
                        f"{versions}\n").encode()
            self.agent_error = payload.get("error")  # EXIT_LINE: the code is the channel's exit status
            if self.agent_error:
                return f"[agent] {self.agent_error}\n".encode()

    def _ignore_control_line(self, error: MalformedControlLine) -> None:
        """A malformed control line carries no pid, no error and no output: ignored and counted, never fatal to the
        thread that reads this rank's output."""
        self.malformed_control_lines += 1
        if self.malformed_control_lines == 1:
            log.warning("rank %d on %s: ignored a malformed agent control line (%s); later ones are only counted",
                        self.rank, self.remote, error)

    def close(self) -> None:
        if self.malformed_control_lines > 1:
            log.warning("rank %d on %s: %d malformed agent control lines ignored", self.rank, self.remote,
                        self.malformed_control_lines)
        self._stream.close()

    # -- life ---------------------------------------------------------------------------------------------------

    def poll(self) -> int | None:
        if not self.channel.exit_status_ready():
            return None
        status = self.channel.recv_exit_status()
        if status < 0:  # the connection went away without an exit status
            return EXIT_CONNECTION_LOST
        return exit_status_to_code(status)

    def terminate(self) -> None:
        self._ask_to_stop(STOP_LINE)

    def abort(self) -> None:
        self._ask_to_stop(ABORT_LINE)

    def _ask_to_stop(self, line: bytes) -> None:
        try:
            self.channel.sendall(line)
            self.channel.shutdown_write()  # EOF on the agent's stdin: it ends the worker's group (signal, grace, KILL)
        except (OSError, EOFError):
            pass

    def kill(self) -> None:
        if self.pgid and not self._killed:
            self._killed = True
            try:
                self.backend.request(self.remote, "kill", {"pgid": self.pgid, "run_key": self.run_key},
                                     timeout_s=KILL_TIMEOUT_S)
            except LaunchError as error:
                log.warning("rank %d on %s: could not SIGKILL process group %s: %s", self.rank, self.remote,
                            self.pgid, error)
        self.channel.close()

    def gone(self) -> bool:
        # The agent exits only once the worker's whole group is gone; a closed channel means the agent lost its
        # stdin and is ending the group itself (release verifies by the run marker).
        return self.channel.exit_status_ready() or self.channel.closed

    def record(self) -> dict[str, Any]:
        return {"conn_id": self.remote.conn_id, "remote_pid": self.pid, "remote_pgid": self.pgid}

    def label(self) -> str:
        return f"rank {self.rank} host {self.host}"


class SSHBackend(Backend):
    name: ClassVar[str] = "ssh"

    def __init__(self, hosts: Sequence[RemoteHost], *, remote_python: str, remote_workdir: str,
                 workers_per_host: int = 0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not hosts:
            raise LaunchError("the ssh backend needs at least one host: set ssh_conn_ids")
        self.hosts = list(hosts)
        self.remote_python = remote_python
        self.remote_workdir = remote_workdir
        self.workers_per_host = workers_per_host
        self.clock, self.sleep = clock, sleep
        self._gpus_settle_until = 0.0  # until then too few free GPUs are probed again (see GPU_SETTLE_POLL_S)
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._host_locks: dict[str, threading.Lock] = {}

    # -- connections --------------------------------------------------------------------------------------------

    def client(self, host: RemoteHost) -> Any:
        with self._lock:
            host_lock = self._host_locks.setdefault(host.conn_id, threading.Lock())
        with host_lock:  # one connection per host; hosts connect in parallel
            client = self._clients.get(host.conn_id)
            transport = client.get_transport() if client else None
            if transport is None or not transport.is_active():
                client = self._connect(host)
                with self._lock:
                    self._clients[host.conn_id] = client
            return client

    def _connect(self, host: RemoteHost) -> Any:
        import paramiko

        try:
            return host.connect()
        except paramiko.BadHostKeyException as error:
            raise HostError(
                f"host {host}: its host key does not match the one the connection names ({error}). If the host "
                "was reinstalled, put its new key in the connection's extra 'host_key' (ssh-keyscan -t ed25519 "
                "-p <port> <host>); otherwise someone may be intercepting the connection.") from None
        except paramiko.SSHException as error:
            if "known_hosts" in str(error) or "host key" in str(error).lower():
                raise HostError(
                    f"host {host}: its host key is unknown ({error}). Add the host's public key to the connection's "
                    "extra as \"host_key\": \"ssh-ed25519 AAAA...\" (from ssh-keyscan -t ed25519 -p <port> <host>), "
                    "or to the known_hosts file of the Airflow worker; host-key checking stays on.") from None
            raise HostError(f"host {host}: SSH failed: {error}. Check the connection's login, key and port.") \
                from None
        except (OSError, EOFError) as error:
            raise HostError(f"host {host} is unreachable: {type(error).__name__}: {error}. Check that the host is "
                            "up, that sshd listens on the connection's port, and the network between them.") \
                from None

    def _open(self, host: RemoteHost, mode: str) -> Any:
        transport = self.client(host).get_transport()
        try:
            channel = transport.open_session(timeout=REQUEST_TIMEOUT_S)
            channel.set_combine_stderr(True)
            channel.exec_command(f"exec {shlex.quote(self.remote_python)} -u -m {AGENT_MODULE} {mode}")
        except Exception as error:  # noqa: BLE001 - paramiko raises SSHException, EOFError or socket errors
            raise HostError(f"host {host}: cannot start the agent over SSH: {type(error).__name__}: {error}. "
                            "The server may limit sessions (raise MaxSessions in sshd_config).") from None
        return channel

    def request(self, host: RemoteHost, mode: str, payload: Mapping[str, Any],
                timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        """One agent call that answers with one JSON line."""
        channel = self._open(host, mode)
        try:
            channel.settimeout(timeout_s)
            channel.sendall(json.dumps(payload).encode() + b"\n")
            channel.shutdown_write()
            output = b""
            try:
                while chunk := channel.recv(65536):
                    output += chunk
            except TimeoutError:
                raise HostError(f"host {host}: the agent's {mode} did not answer within {timeout_s:g} s") from None
            status = channel.recv_exit_status()
        finally:
            channel.close()
        last = output.strip().splitlines()[-1] if output.strip() else b""
        try:
            answer = json.loads(last)
        except ValueError:
            hint = ("remote_python does not exist on that host: set remote_python to the worker environment's "
                    "interpreter there" if status == 127 else
                    "is the project installed in remote_python's environment on that host?")
            raise HostError(f"host {host}: `{self.remote_python} -m {AGENT_MODULE} {mode}` exited {status}: "
                            f"{output.decode(errors='replace').strip()[-500:] or 'no output'} ({hint})") from None
        if "error" in answer:
            raise HostError(f"host {host}: agent {mode}: {answer['error']}")
        return answer

    def ask_all(self, hosts: Sequence[RemoteHost], mode: str,
                payload: Mapping[str, Any] | Callable[[RemoteHost], Mapping[str, Any]],
                timeout_s: float = REQUEST_TIMEOUT_S) -> list[dict[str, Any] | HostError]:
        """Every host's answer to one agent call (`payload`, or `payload(host)` for a host's own), or the HostError it
        failed with, asked in parallel (each costs a connection and an agent start: a quarter of a second on
        loopback, more across a network)."""
        def ask(host: RemoteHost) -> dict[str, Any] | HostError:
            try:
                return self.request(host, mode, payload(host) if callable(payload) else payload, timeout_s=timeout_s)
            except HostError as error:
                return error

        with ThreadPoolExecutor(max(1, min(len(hosts), MAX_PARALLEL_REQUESTS)),
                                thread_name_prefix=f"ssh-{mode}") as pool:
            return list(pool.map(ask, hosts))

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

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
