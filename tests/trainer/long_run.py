"""Long runs of the real trainer through the launcher, watched from /proc: for tests and `make bench`.

`TrainGroup` launches `python -m trainer.train` on local workers with the launcher's `WorkerGroup` (in a
background thread, so a test can interfere while it runs), and samples each worker's thread count
(`/proc/<pid>/task`) and resident memory (`VmRSS`) together with the step its metrics file has reached, from launch
until the workers exit. The settings make steps as short as the trainer allows (tiny preset, one sequence of 8
tokens per worker), so thousands of steps take a minute or two on a CPU.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from launcher import GroupSpec, LocalBackend, RunResult, WorkerGroup, WorkerOutcome
from tests.trainer.shards import write_dataset

REPO = Path(__file__).resolve().parents[2]
# Batches of one 8-token sequence: their loss swings by several nats from step to step, so the divergence watch is
# off (these runs test processes, threads and resumes; a test that wants the watch sets max_loss_rise itself).
FAST_STEPS = {
    "model": "tiny", "tokenizer": "bpe:260", "block_size": 8, "batch_size_per_worker": 1, "warmup_steps": 1,
    "learning_rate": 1e-3, "max_loss_rise": 0,
}
SAMPLE_INTERVAL_S = 0.2


def write_tiny_dataset(directory: Path) -> str:
    """Shards of 8-token sequences from a slice of the sample plays; returns the manifest path."""
    return write_dataset(directory, sorted((REPO / "data" / "sample").glob("*.txt")), block_size=8, vocab_size=260,
                         num_train_shards=4, max_chars=20_000)


@dataclass(frozen=True)
class Sample:
    rank: int
    step: int  # last step in the rank's metrics file when sampled (0: none yet)
    threads: int
    rss_bytes: int


def read_process(pid: int) -> tuple[int, int] | None:
    """(threads, resident bytes) of a live process from /proc; None once it is gone."""
    try:
        threads = len(os.listdir(f"/proc/{pid}/task"))
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss_kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
    if rss_kib is None:  # a zombie has no memory lines
        return None
    return threads, rss_kib * 1024


def last_step(metrics_file: Path) -> int:
    """The step of the last complete line of a metrics file (0 when there is none)."""
    try:
        with metrics_file.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - 4096))
            tail = handle.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return 0
    lines = [line for line in tail.split("\n")[:-1] if line.startswith("{")]  # the last one may be half-written
    return json.loads(lines[-1])["step"] if lines else 0


class TrainGroup:
    """One `trainer.train` job as a launcher worker group: config, output, launches, samples."""

    def __init__(self, root: Path, manifest: str, *, output: str | None = None, hang_timeout_s: float = 120,
                 **settings) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.config = {"num_workers": 2, "storage_root": str(root / "storage"), **FAST_STEPS, **settings}
        (root / "config.json").write_text(json.dumps(self.config))
        self.output = output or str(root / "output")
        self.spec = GroupSpec(
            name="train", entrypoint="trainer.train", num_workers=self.config["num_workers"],
            args=("--config", str(root / "config.json"), "--manifest", manifest, "--output", self.output),
            env={"PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}, startup_timeout_s=300,
            hang_timeout_s=hang_timeout_s, grace_period_s=5,
        )
        self.launches = 0
        self.workers: list[WorkerOutcome] = []  # of the current launch, once started
        self.samples: list[Sample] = []
        self.lines: list[tuple[int, str]] = []
        self.result: RunResult | None = None
        self._group: WorkerGroup | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # -- launching ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Launch the group in a background thread (a retry: call again after `wait`)."""
        self.launches += 1
        self.workers, self.samples, self.lines, self.result = [], [], [], None
        self._started.clear()
        self._group = WorkerGroup(self.spec, LocalBackend(), self.root / f"launch-{self.launches}",
                                  on_line=lambda rank, line: self.lines.append((rank, line)),
                                  on_started=self._on_started)
        self._thread = threading.Thread(target=self._run, name=f"train-launch-{self.launches}", daemon=True)
        self._thread.start()

    def _on_started(self, workers, attempt: int) -> None:
        self.workers = list(workers)
        self._started.set()
        threading.Thread(target=self._sample, args=(list(workers),), daemon=True).start()

    def _run(self) -> None:
        self.result = self._group.run()

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float) -> RunResult:
        """The launch's result; a launch still running after `timeout_s` is stopped and reported by the assert."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.stop(f"the test gave up after {timeout_s:g} s")
            raise AssertionError(f"launch {self.launches} still running after {timeout_s:g} s:\n{self.log_text()}")
        return self.result

    def stop(self, reason: str) -> None:
        self._group.stop(reason)
        self._thread.join()

    def wait_for(self, condition, timeout_s: float, what: str) -> None:
        """Poll `condition()` until true; fail (naming `what`) if the launch ends or time runs out first."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert self.running(), f"launch {self.launches} ended before {what}: {self.result}\n{self.log_text()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s:\n{self.log_text()}"
            time.sleep(0.05)

    # -- observing ------------------------------------------------------------------------------------------------

    def metrics_file(self, rank: int) -> Path:
        return Path(self.output) / "metrics" / f"rank-{rank}.jsonl"

    def _sample(self, workers: list[WorkerOutcome]) -> None:
        live = {w.rank: w.pid for w in workers}
        while live:
            for rank, pid in list(live.items()):
                reading = read_process(pid)
                if reading is None:
                    del live[rank]
                    continue
                self.samples.append(Sample(rank, last_step(self.metrics_file(rank)), *reading))
            time.sleep(SAMPLE_INTERVAL_S)

    def rank_samples(self, rank: int) -> list[Sample]:
        return [s for s in self.samples if s.rank == rank]

    def log_text(self, last: int = 60) -> str:
        return "\n".join(f"[rank {rank}] {line}" for rank, line in self.lines[-last:])
