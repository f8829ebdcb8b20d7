"""A rank of the SSH backend behind its agent (`launcher.agent`): the rank's output with the agent's control lines
taken out (the agent's pid, its error), its exit status from the session channel, and stopping it: the stop line and
EOF on the agent's stdin (the group's grace period applies), or SIGKILL of its process group through another agent
call.
"""

from __future__ import annotations

import logging
from typing import IO, Any

from core.protocol import ABORT_LINE, AGENT_LINE, STOP_LINE, MalformedControlLine, read_control_line
from launcher.backend import WorkerHandle
from launcher.errors import LaunchError
from launcher.process import exit_status_to_code
from launcher.ssh_agents import AgentClient, RemoteHost

log = logging.getLogger("launcher.ssh")  # the backend's logger: one name for all its messages

EXIT_CONNECTION_LOST = 255  # what ssh(1) reports when the connection, not the command, ended
KILL_TIMEOUT_S = 3.0  # kill runs inside Airflow's 5 s on_kill budget


class SSHWorkerHandle(WorkerHandle):
    """A rank behind its agent. The output stream hides the agent's control lines and keeps what they say."""

    def __init__(self, backend: AgentClient, host: RemoteHost, rank: int, channel: Any, run_key: str) -> None:
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
