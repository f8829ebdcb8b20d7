"""The idle-held warning live (issue 40, item 4): real tiny workers that keep printing while their live step stays
frozen, watched by the one launch path (tasks/launch.py + launcher/idle.py). The warning is logged, recorded with the
attempt's GPU-time events, shown and counted in the report's usage, and mailed on a thread of its own: a mail server
that hangs never holds up the group."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from core.config import RunConfig
from core.layout import StorageLayout, run_key
from core.protocol import EXIT_PREEMPTED
from launcher import GroupSpec, GroupState, LocalBackend
from tasks import alerts
from tasks.launch import IdleSettings, RecordedLaunch, live_step
from tasks.ledger.record import load_attempts, run_usage
from tasks.release import processes_of_run
from tasks.report.parts import run_view
from tasks.report.store import render_markdown
from tests.launcher.conftest import entrypoint_env
from tests.tasks.report.test_store import document
from trainer.metrics import LIVE_PREFIX

# Its own run key: release and the orphan reaper end processes by run key machine-wide, and other test files that
# launch workers run as "run-1" beside this one.
RUN_KEY = "ledger-idle-run"

MAIL_HANGS_S = 15.0


def test_live_step_reads_only_the_workers_live_lines():
    assert live_step(LIVE_PREFIX + '{"scope": "worker", "values": {"step": 7, "loss": 2.5}}') == 7
    assert live_step(LIVE_PREFIX + '{"scope": "preflight", "values": {"busbw_gbps": 1}}') is None
    assert live_step(LIVE_PREFIX + '{"scope": "worker", "values": {"loss": 2.5}}') is None
    assert live_step(LIVE_PREFIX + "not json") is None and live_step("rank 0 step 7 done") is None


def test_ranks_that_talk_but_do_not_train_warn_once_live_and_a_hanging_mail_never_holds_the_group(
        monkeypatch, tmp_path):
    sent: list[tuple] = []
    done = threading.Event()

    def hanging_send(*args, **kw) -> bool:  # an SMTP server that answers after MAIL_HANGS_S
        time.sleep(MAIL_HANGS_S)
        sent.append((args, kw))
        done.set()
        return True

    monkeypatch.setattr(alerts, "send_alert", hanging_send)
    config = RunConfig.of(max_idle_held_s=1, idle_gpu_util_pct=5, alert_conn_id="smtp", alert_emails=["a@b.example"])
    run = StorageLayout(str(tmp_path / "storage")).run(RUN_KEY)
    spec = GroupSpec(name="train", entrypoint="tiny_worker", num_workers=2, run_key=RUN_KEY, startup_timeout_s=60,
                     hang_timeout_s=60, grace_period_s=2,
                     env=entrypoint_env(TINY_WORKER_STEPS="35", TINY_WORKER_STEP_S="0.1", TINY_WORKER_LIVE_STEPS="3"))
    lines: list[str] = []
    launch = RecordedLaunch(spec, LocalBackend(), run, on_line=lambda rank, line: lines.append(line),
                            idle=IdleSettings.of(config, "manual__1", "train"))
    started = time.monotonic()
    result = launch.run_group()
    wall_s = time.monotonic() - started
    assert result.succeeded, result.error_message()
    assert not done.is_set() and wall_s < MAIL_HANGS_S, "the group waited for the mail"
    assert any(line.startswith(LIVE_PREFIX) for line in lines)

    (attempt,) = load_attempts(run.url)
    (warning,) = attempt.idle_warnings  # one episode: both ranks froze at step 2 together
    print(f"\ngroup {wall_s:.2f} s; warning: {warning.text}")
    # Usually both ranks cross the limit in the same poll; on a loaded machine one may cross a poll earlier, and the
    # other joins the same episode without a second warning.
    ranks = warning.ranks
    assert ranks in ((0,), (1,), (0, 1)) and warning.slots == tuple(f"127.0.0.1/rank{rank}" for rank in ranks)
    assert 1.0 < warning.idle_s < 10 and warning.phase == {str(rank): "after step 2" for rank in ranks}
    assert warning.peak_util_pct is None  # a CPU run: progress alone decides
    assert "max_idle_held_s = 1" in warning.text and "The run goes on." in warning.text

    assert done.wait(MAIL_HANGS_S + 5), "the mail was sent after all, off the watch loop"
    (conn, recipients, subject, body), kw = sent[0]
    assert conn == "smtp" and recipients == ("a@b.example",) and "GPUs held idle in train" in subject
    assert warning.text in body and kw == {"run": run_key("gpt_finetune", "manual__1"), "task": "train"}

    report = replace(document(baseline=False), run_key=RUN_KEY, config=config.to_dict())
    summary = run_usage(run.url, report, "2030-01-01T00:00:00+00:00")
    assert summary.to_xcom()["idle_warnings"] == [{"group": "train", "attempt": 1, **warning.to_xcom()}]
    page = render_markdown(run_view(report, None, {"usage": summary.to_xcom()}))
    assert "Idle-held warnings (checked live while groups ran, max_idle_held_s): 1;" in page
    assert f"train slots {', '.join(warning.slots)} idle" in page


def test_idle_settings_come_from_the_prepared_configuration_and_mail_only_with_a_connection():
    config = RunConfig.of(max_idle_held_s=600, idle_gpu_util_pct=10)
    quiet = IdleSettings.of(config, "manual__1", "train")
    assert (quiet.max_idle_held_s, quiet.idle_gpu_util_pct, quiet.mail) == (600.0, 10.0, None)
    mailed = config.replace(alert_conn_id="smtp", alert_emails=["ops@example.com"])
    assert IdleSettings.of(mailed, "manual__1", "train").mail is not None
    assert IdleSettings.of(mailed, None, "evaluate-baseline").mail is None  # no run id
    assert IdleSettings.of(config.replace(max_idle_held_s=0), "manual__1", "train").max_idle_held_s == 0  # off


def test_a_group_held_idle_past_the_reclaim_limit_checkpoints_ends_and_is_counted_in_the_ledger(monkeypatch, tmp_path):
    """Two tiny workers talk but no longer train (their live step frozen at 2): at reclaim_idle_after_s the group is
    stopped with SIGTERM, each rank saves its checkpoint and exits, the slots are proven free, the reclaim is mailed,
    and the ledger and the report say what was reclaimed and why."""
    sent: list[tuple] = []
    monkeypatch.setattr(alerts, "send_alert", lambda *args, **kw: sent.append((args, kw)) or True)
    config = RunConfig.of(max_idle_held_s=1, reclaim_idle_after_s=2, alert_conn_id="smtp",
                          alert_emails=["a@b.example"])
    run = StorageLayout(str(tmp_path / "storage")).run(RUN_KEY)
    checkpoints = tmp_path / "checkpoints"
    spec = GroupSpec(name="train", entrypoint="tiny_worker", num_workers=2, run_key=RUN_KEY, startup_timeout_s=60,
                     hang_timeout_s=60, grace_period_s=10,
                     env=entrypoint_env(TINY_WORKER_STEPS="100000", TINY_WORKER_STEP_S="0.1",
                                        TINY_WORKER_LIVE_STEPS="3", TINY_WORKER_CHECKPOINT_ON_TERM=str(checkpoints)))
    launch = RecordedLaunch(spec, LocalBackend(), run, on_line=lambda rank, line: None,
                            idle=IdleSettings.of(config, "manual__1", "train"))
    started = time.monotonic()
    result = launch.run_group()
    wall_s = time.monotonic() - started
    print(f"\nreclaimed after {wall_s:.2f} s: {launch.reclaimed.text}")

    assert result.state is GroupState.STOPPED and wall_s < 30
    assert {w.rank: w.exit_code for w in result.workers} == {0: EXIT_PREEMPTED, 1: EXIT_PREEMPTED}
    assert sorted(path.name.split("-step-")[0] for path in checkpoints.iterdir()) == ["rank-0", "rank-1"]
    assert processes_of_run(RUN_KEY) == {}
    assert launch.after_exit is not None and launch.after_exit.proven, launch.after_exit
    reclaim = launch.reclaimed
    assert reclaim.text.startswith("reclaimed after 2 s idle: GPU time: train (attempt 1) held 2 slot(s)")
    assert "reclaim_idle_after_s = 2" in reclaim.text and reclaim.ranks == (0, 1) and 2 <= reclaim.idle_s < 5

    (attempt,) = load_attempts(run.url)
    # One warning at least (a second when the ranks took over the window to start on a loaded machine).
    assert attempt.state == "stopped" and attempt.reclaimed == reclaim and len(attempt.idle_warnings) >= 1
    subjects = [args[2] for args, kw in sent]
    assert "GPUs held idle reclaimed from train" in " ".join(subjects), subjects
    body = next(args[3] for args, kw in sent if "reclaimed" in args[2])
    assert "its task train fails by this" in body and reclaim.text in body

    report = replace(document(baseline=False), run_key=RUN_KEY, config=config.to_dict())
    summary = run_usage(run.url, report, "2030-01-01T00:00:00+00:00")
    assert summary.reclaimed_gpu_h == round(2 * reclaim.idle_s / 3600, 6) > 0
    assert summary.to_xcom()["reclaims"] == [{"group": "train", "attempt": 1, **reclaim.to_xcom()}]
    page = render_markdown(run_view(report, None, {"usage": summary.to_xcom()}))
    assert "Reclaimed (held idle past reclaim_idle_after_s, stopped, the task failed without a retry): 1," in page
    assert "train (attempt 1) slots 127.0.0.1/rank0, 127.0.0.1/rank1 idle" in page
