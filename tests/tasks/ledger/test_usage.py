"""The GPU-time ledger (tasks/ledger/usage.py) on hand-written timelines, the price table (tasks/ledger/pricing.py) and
what the report's `usage` says (held, busy, idle by cause, cost)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from core.config import ConfigError
from core.document import DocumentError
from tasks.ledger import pricing, usage
from tasks.ledger.summary import AttemptRow, LiveWarning, summarize
from tasks.ledger.usage import IdleWarning, RankEvents, RankTimeline, Timeline
from tests.tasks.report.test_store import document_of, view_of
from tests.tasks.report.test_store import report as base_report


def rank(r, launch, ready, end, first=None, last=None, redone=None, host="h", gpus=()):
    return RankTimeline(RankEvents(rank=r, host=host, gpus=tuple(gpus), launch=launch, exit=end, exit_code=0,
                                   ready=ready), first_step_end=first, last_step_end=last, redone_after=redone)


def attempt(kind, *ranks):
    return Timeline(kind, ranks)


def rank_file(r, launch, ready, end):
    """A rank as an attempt file keeps it (written by tasks/launch.py)."""
    return {"rank": r, "host": "h", "gpus": [], "launch": launch, "ready": ready, "exit": end, "exit_code": 0}


def causes(book, slot=None):
    part = book.slots[slot] if slot else book
    return {cause: round(s, 6) for cause, s in part.idle_by_cause_s.items() if s}


def assert_invariants(book):
    """Causes sum to idle, idle = held - busy, per slot and for the run; per-slot sums equal the run's."""
    for part in (book, *book.slots.values()):
        assert sum(part.idle_by_cause_s.values()) == pytest.approx(part.idle_s, abs=1e-6)
        assert part.held_s - part.busy_s == pytest.approx(part.idle_s, abs=1e-6)
        assert all(value >= -1e-9 for value in part.idle_by_cause_s.values())
    slots = book.slots.values()
    for name in ("held_s", "busy_s", "idle_s"):
        assert sum(getattr(s, name) for s in slots) == pytest.approx(getattr(book, name), abs=1e-6)
    for cause in usage.CAUSES:
        assert sum(s.idle_by_cause_s[cause] for s in slots) == pytest.approx(book.idle_by_cause_s[cause])


TWO_WORKERS = [
    attempt("preflight", rank(0, 0, 5, 10), rank(1, 0, 5, 10)),
    attempt("train", rank(0, 15, 20, 50, 25, 45), rank(1, 15, 20, 50, 25, 45)),
    attempt("evaluate", rank(0, 55, 58, 65)),
]


def test_two_workers_every_second_has_one_cause():
    """2 workers: preflight, train, a 1-worker evaluation, release 5 s after the last exit."""
    book = usage.ledger(TWO_WORKERS, released_at=70)
    assert_invariants(book)
    assert book.held_s == 140 and book.busy_s == 40
    assert causes(book, "h/rank0") == {"startup": 13, "preflight": 5, "between_tasks": 10, "compile": 5, "export": 5,
                                       "evaluation": 7, "release": 5}
    # rank 1's slot has no evaluation: from its last exit to release it waits for release
    assert causes(book, "h/rank1") == {"startup": 10, "preflight": 5, "between_tasks": 5, "compile": 5, "export": 5,
                                       "release": 20}
    assert book.time_to_release_s == 5 and book.clock_skew_s == 0 and book.idle_by_cause_s["other"] == 0


def test_elastic_four_to_two_counts_the_left_slots_until_release():
    """Elastic 4 -> 2: the failed 4-worker launch's steps are redone; slots 2 and 3 are held until release."""
    failed = attempt("train", *(rank(r, 0, 5, 30, 5, 30, redone=5) for r in range(4)))
    relaunch = attempt("train", rank(0, 40, 45, 75, 50, 70), rank(1, 40, 45, 75, 50, 70))
    book = usage.ledger([failed, relaunch], released_at=80)
    assert_invariants(book)
    assert causes(book, "h/rank0") == {"startup": 10, "redone": 25, "between_tasks": 10, "compile": 5, "export": 5,
                                       "release": 5}
    assert book.slots["h/rank0"].busy_s == 20
    assert causes(book, "h/rank3") == {"startup": 5, "redone": 25, "release": 50}
    assert book.held_s == 4 * 80 and book.busy_s == 40


def test_retried_attempt_redone_steps_are_idle_not_busy():
    """A retry resumed at the checkpoint the first attempt reached at t=30: its steps from 30 to 40 are redone."""
    first = attempt("train", rank(0, 0, 5, 42, 10, 40, redone=30))
    retry = attempt("train", rank(0, 50, 55, 90, 60, 85))
    book = usage.ledger([first, retry], released_at=90)
    assert_invariants(book)
    assert book.busy_s == 20 + 25
    assert causes(book) == {"startup": 10, "compile": 10, "redone": 10, "export": 7, "between_tasks": 8}


def test_late_rank_makes_the_others_wait_in_the_rendezvous():
    book = usage.ledger([attempt("train", rank(0, 0, 5, 40, 20, 35), rank(1, 0, 12, 40, 20, 35))], released_at=40)
    assert_invariants(book)
    assert book.slots["h/rank0"].idle_by_cause_s["stragglers"] == 7
    assert book.slots["h/rank1"].idle_by_cause_s["stragglers"] == 0
    assert book.slots["h/rank1"].idle_by_cause_s["startup"] == 12


@pytest.mark.parametrize("workers,delay", [(2, 3.0), (4, 7.5), (8, 0.25)])
def test_one_rank_started_d_seconds_late_gives_stragglers_d_times_n_minus_1(workers, delay):
    """Every rank takes 4 s to start; rank 1 is launched `delay` late: the other N-1 wait `delay` each."""
    ranks = [rank(r, (delay if r == 1 else 0), (delay if r == 1 else 0) + 4, 60, 30, 55) for r in range(workers)]
    book = usage.ledger([attempt("train", *ranks)], released_at=61)
    assert_invariants(book)
    assert book.idle_by_cause_s["stragglers"] == pytest.approx(delay * (workers - 1))


def test_gap_before_release_is_release_time():
    book = usage.ledger([attempt("train", rank(0, 0, 2, 20, 5, 15))], released_at=120)
    assert_invariants(book)
    assert book.time_to_release_s == 100 and causes(book)["release"] == 100


def test_release_clock_behind_the_last_exit_is_clamped_and_reported():
    """Release ran on a host whose clock is 5 s behind: the window ends at the last exit, the skew is reported."""
    book = usage.ledger([attempt("train", rank(0, 0, 2, 50, 5, 45))], released_at=45)
    assert_invariants(book)
    assert book.clock_skew_s == 5 and book.time_to_release_s == 0
    assert book.held_s == 50 and "release" not in causes(book)


def test_groups_whose_clocks_overlap_still_partition_the_held_time():
    """Evaluate's launcher clock runs 3 s behind train's: the overlap is counted once (busy wins)."""
    book = usage.ledger([attempt("train", rank(0, 0, 2, 30, 5, 28)), attempt("evaluate", rank(0, 27, 29, 40))], 41)
    assert_invariants(book)
    assert book.busy_s == 23 and book.held_s == 41


def _random_attempt(rng, hosts, start):
    kind = rng.choice(["preflight", "train", "baseline", "evaluate", "train"])
    workers = rng.randint(1, 4)
    ranks = []
    for r in range(workers):
        launch = start + rng.uniform(0, 3)
        ready = None if rng.random() < 0.1 else launch + rng.uniform(0, 10)
        first = (ready or launch) + rng.uniform(0, 8)
        last = first + rng.uniform(0, 30)
        end = last + rng.uniform(0, 6)
        redone = rng.uniform(first, last) if rng.random() < 0.2 else None
        ranks.append(rank(r, launch, ready, end, first, last, redone, host=rng.choice(hosts),
                          gpus=[r] if rng.random() < 0.5 else []))
    return attempt(kind, *ranks), max(r.events.exit for r in ranks)


@pytest.mark.parametrize("seed", range(40))
def test_random_timelines_keep_the_invariants(seed):
    rng = random.Random(seed)
    attempts, clock = [], 0.0
    for _ in range(rng.randint(1, 6)):
        made, clock = _random_attempt(rng, ["a", "b"], clock + rng.uniform(-2, 10))  # some overlap (skew)
        attempts.append(made)
    released = clock + rng.uniform(-5, 20)
    book = usage.ledger(attempts, released)
    assert_invariants(book)
    assert book.idle_by_cause_s["other"] == 0  # every kind is a known one
    assert book.clock_skew_s == pytest.approx(max(0.0, clock - released))
    waits = [(start, start + rng.uniform(0, 15)) for start in (rng.uniform(-10, clock) for _ in range(3))]
    waited = usage.ledger(attempts, released, waits)  # admission waits: out of held, never out of a group's time
    assert_invariants(waited)
    assert waited.held_s + waited.waited_s == pytest.approx(book.held_s)
    assert waited.busy_s == pytest.approx(book.busy_s)
    for cause in usage.CAUSES:
        change = book.idle_by_cause_s[cause] - waited.idle_by_cause_s[cause]
        assert change == pytest.approx(waited.waited_s if cause == "between_tasks" else 0, abs=1e-6)


# -- prices --------------------------------------------------------------------------------------------------

TABLE = {"currency": "EUR", "default": {"on_demand": 2.5, "spot": 1.0},
         "accelerators": {"NVIDIA H200": {"on_demand": 3.8, "reserved": 2.1, "spot": 1.4}},
         "backends": {"kubernetes": {"accelerators": {"NVIDIA H200": {"on_demand": 4.1}}}},
         "queues": {"gpu_spot": {"default": {"spot": 1.2}, "accelerators": {"NVIDIA H200": {"spot": 1.3}}}},
         "cpu_worker": {"on_demand": 0.05}}


def freeze(**kw):
    settings = {"backend": "local", "queue": "", "capacity": "on_demand", "use_gpu": True, **kw}
    return pricing.freeze(pricing.parse_table(json.dumps(TABLE), "t"), "t", **settings)


def test_price_precedence_queue_over_backend_over_table():
    assert freeze().rates["NVIDIA H200"] == 3.8
    assert freeze(backend="kubernetes").rates["NVIDIA H200"] == 4.1
    spot = freeze(backend="kubernetes", queue="gpu_spot", capacity="spot")
    assert spot.rates["NVIDIA H200"] == 1.3 and spot.default == 1.2
    assert "queues.gpu_spot" in spot.source
    assert spot.rates.keys() == {"NVIDIA H200"} and freeze(capacity="reserved").default is None  # none for reserved
    cpu = freeze(use_gpu=False)
    assert cpu.unit == "worker_hour" and cpu.default == 0.05 and cpu.rates == {}


def test_the_frozen_price_reads_back_exactly_and_a_mistyped_one_is_refused_by_name(tmp_path):
    """XCom and usage/price.json keep the price's keys and numbers as written (a rate of 1 stays 1); a file or XCom
    that carries another shape is refused, naming the file and the field."""
    from core.storage import read_json, write_json_atomic
    from tasks.dataset.plan import DatasetPlan
    from tasks.ledger.record import read_price, write_price

    price = pricing.freeze(pricing.parse_table(json.dumps({"currency": "EUR", "cpu_worker": {"on_demand": 1}}), "t"),
                           "t", backend="local", queue="", capacity="on_demand", use_gpu=False)
    run_url = str(tmp_path / "run")
    write_price(run_url, price)
    stored = read_json(f"{run_url}/usage/price.json")
    assert stored == {"price": {"currency": "EUR", "capacity": "on_demand", "unit": "worker_hour", "default": 1,
                                "rates": {}, "source": "t"}}
    assert isinstance(stored["price"]["default"], int) and read_price(run_url) == price
    assert pricing.Price.from_xcom(price.to_xcom()) == price
    plan = DatasetPlan(fingerprint="f", manifest_url="m", cache_hit=True, config={}, price=price)
    assert DatasetPlan.from_xcom(plan.to_xcom()).price == price  # prepare's XCom, on to the prepared run's
    write_price(run_url, None)
    assert read_price(run_url) is None and read_price(str(tmp_path / "older-run")) is None
    for bad, field in (({**price.to_xcom(), "default": "1"}, "Price.default"),
                       ({**price.to_xcom(), "rates": {"A100": -2}}, "Price.rates.A100"),
                       ({**price.to_xcom(), "unit": "hour"}, "Price.unit")):
        write_json_atomic(f"{run_url}/usage/price.json", {"price": bad})
        with pytest.raises(DocumentError, match=field) as refused:
            read_price(run_url)
        assert "usage/price.json" in str(refused.value)
    write_json_atomic(f"{run_url}/usage/price.json", price.to_xcom())  # not under "price"
    with pytest.raises(DocumentError, match="price.json: expected"):
        read_price(run_url)


@pytest.mark.parametrize("text,named", [
    ("{not json", "not JSON"),
    (json.dumps({**TABLE, "default": {"on_demand": -1}}), "default.on_demand"),
    (json.dumps({**TABLE, "accelerators": {"A100": {"spot": "cheap"}}}), "accelerators.A100.spot"),
    (json.dumps({**TABLE, "cpu_worker": {"hourly": 1}}), "cpu_worker.hourly"),
    (json.dumps({**TABLE, "queues": {"q": {"default": {"spot": float("nan")}}}}), "queues.q.default.spot"),
    (json.dumps({"default": {"on_demand": 1}}), "currency"),
])
def test_a_bad_table_is_refused_by_name(text, named):
    with pytest.raises(ConfigError, match=named) as caught:
        pricing.parse_table(text, "t")
    assert pricing.PRICING_ENV in str(caught.value)


def test_table_from_env_inline_or_file(tmp_path):
    assert pricing.table_from_env({}) == (None, None)
    assert pricing.table_from_env({pricing.PRICING_ENV: json.dumps(TABLE)})[0].currency == "EUR"
    path = tmp_path / "prices.json"
    path.write_text(json.dumps(TABLE))
    assert pricing.table_from_env({pricing.PRICING_ENV: str(path)})[1] == str(path)
    with pytest.raises(ConfigError, match="cannot read"):
        pricing.table_from_env({pricing.PRICING_ENV: str(tmp_path / "missing.json")})


def test_no_table_means_no_cost_never_zero():
    book = usage.ledger(TWO_WORKERS, released_at=70)
    summary = summarize(book, price=pricing.freeze(None, None, backend="local", queue="", capacity="on_demand",
                                                           use_gpu=False), tokens=1000)
    assert summary.cost is None and summary.price is None
    assert summary.held_gpu_h == pytest.approx(140 / 3600, abs=1e-6)


def test_cost_is_held_times_rate_and_unknown_accelerator_uses_the_default():
    book = usage.ledger(TWO_WORKERS, released_at=70)
    summary = summarize(book, price=freeze(), accelerator="NVIDIA B200", tokens=2_000_000, efficiency=0.8)
    assert summary.price.rate == 2.5 and "NVIDIA B200" in summary.price.note
    assert summary.cost.held == pytest.approx(140 / 3600 * 2.5, abs=1e-6)
    assert summary.cost.per_mtoken == pytest.approx(140 / 3600 * 2.5 / 2, abs=1e-6)
    assert summary.cost.extra_for_parallelism == pytest.approx(40 / 3600 * 2.5 * 0.2, abs=1e-6)
    assert summary.busy_share == pytest.approx(40 / 140, abs=1e-4)
    known = summarize(book, price=freeze(), accelerator="NVIDIA H200")
    assert known.price.rate == 3.8 and known.price.note is None


# -- the launch path's events and the report's usage -----------------------------------------------------------

def test_the_launch_path_writes_one_event_file_per_group_attempt(tmp_path):
    """RecordedLaunch appends usage/<group>-<launch>-a<attempt>.json: launch <= ready <= exit per rank, once."""
    from core.layout import StorageLayout
    from tasks.launch import RecordedLaunch
    from tasks.ledger.record import load_attempts
    from tests.launcher.fake_backend import FakeBackend
    from tests.tasks.test_launch import scripts, spec

    run = StorageLayout(str(tmp_path / "storage")).run("run-1")
    for _ in range(2):  # a retry of the task: a second file, the first kept
        RecordedLaunch(spec(name="train"), FakeBackend(scripts()), run, on_line=lambda *_: None).run_group()
    attempts = load_attempts(run.url)
    assert [(a.group, a.kind, a.attempt, a.state, a.backend) for a in attempts] == [("train", "train", 1,
                                                                                     "succeeded", "fake")] * 2
    for made in attempts:
        assert [r.rank for r in made.ranks] == [0, 1]
        for r in made.ranks:
            assert r.launch <= r.ready <= r.exit and r.exit_code == 0
    assert attempts[0].ranks[0].exit <= attempts[1].ranks[0].launch


def test_an_attempt_file_of_another_shape_is_refused_naming_the_file_and_the_field(tmp_path):
    from core.storage import write_json_atomic
    from tasks.ledger.record import load_attempts

    run_url = str(tmp_path / "run")
    good = {"group": "evaluate-baseline", "backend": "local", "attempt": 1, "try_number": "1", "state": "succeeded",
            "ranks": [{"rank": 0, "host": "h", "gpus": [0], "launch": 1.0, "exit": 2.5, "exit_code": None}]}
    write_json_atomic(f"{run_url}/usage/evaluate-baseline-1-a1.json", good)  # never joined: no "ready"
    (made,) = load_attempts(run_url)
    assert made.kind == "evaluate" and made.ranks[0].ready is None and made.idle_warnings == ()
    assert made.to_xcom() == good and made.ranks[0].slots == ["h/gpu0"]  # written back, the same keys and values
    write_json_atomic(f"{run_url}/usage/train-2-a1.json", {**good, "ranks": [{**good["ranks"][0], "exit": "late"}]})
    with pytest.raises(DocumentError,
                       match=r"train-2-a1.json: AttemptEvents.ranks\[0\]: RankEvents.exit: expected float, got str"):
        load_attempts(run_url)


def _write_run(tmp_path, price):
    from core.storage import write_json_atomic
    from tasks.ledger.record import write_price

    run_url = str(tmp_path / "run")
    write_price(run_url, price)
    train = tmp_path / "run" / "train"
    (train / "metrics").mkdir(parents=True)
    (train / "metrics" / "rank-0.jsonl").write_text(json.dumps({"step": 12, "time": 1000.0 + 41.5}) + "\n")
    made = {"backend": "local", "attempt": 1, "try_number": "1", "state": "succeeded"}
    write_json_atomic(f"{run_url}/usage/preflight-1-a1.json", {"group": "preflight", **made,
                      "ranks": [rank_file(r, 1000, 1004, 1010) for r in range(2)]})
    write_json_atomic(f"{run_url}/usage/train-2-a1.json", {"group": "train", **made,
                      "ranks": [rank_file(r, 1012, 1016 + r, 1045) for r in range(2)]})
    report = base_report(workers=2, baseline=False)
    report["runs"]["distributed"].update(train_time_s=20.0, tokens_seen=4096, summary_url=str(train / "summary.json"),
                                         finished_at="1970-01-01T00:17:23+00:00")
    report.update(config={"max_release_s": 2, "min_cost_efficiency": 0.5},
                  hardware={"line": "cpu", "distributed": {"gpu": None}})
    return run_url, document_of(report)


def test_attach_usage_prices_held_time_and_places_steps_before_the_exit(tmp_path):
    """The report's usage from the files: busy = train_time_s x workers, cost = held x rate, slow release warned."""
    from tasks.ledger.record import attach_usage

    price = freeze(use_gpu=False)
    run_url, report = _write_run(tmp_path, price)
    summary, charts = attach_usage(f"{run_url}/report", report, "1970-01-01T00:17:30+00:00")  # 5 s after the exit
    got = summary.to_xcom()
    assert got["busy_gpu_h"] == pytest.approx(2 * 20 / 3600, abs=1e-6)
    assert got["held_gpu_h"] == pytest.approx(2 * 50 / 3600, abs=1e-6)
    assert got["cost"]["held"] == pytest.approx(got["held_gpu_h"] * 0.05, abs=1e-6)
    assert got["price"]["unit"] == "worker_hour" and got["time_to_release_s"] == 5
    # the last metrics line came 1.5 s before the summary: the steps end 1.5 s before the exit
    assert got["idle_by_cause_gpu_h"]["export"] == pytest.approx(2 * 1.5 / 3600, abs=1e-6)
    assert any("max_release_s = 2" in w for w in summary.warnings)
    assert not any("mostly idle" in w for w in summary.warnings)  # under 1 held hour: too small to call
    assert charts["usage.png"].startswith(b"\x89PNG")


def test_no_price_no_cost_and_no_ledger_no_usage(tmp_path):
    from tasks.ledger.record import attach_usage

    run_url, report = _write_run(tmp_path, None)
    summary, _ = attach_usage(f"{run_url}/report", report, "1970-01-01T00:17:30+00:00")
    assert summary.cost is None and summary.held_gpu_h > 0
    assert attach_usage(str(tmp_path / "other" / "report"), report, "1970-01-01T00:17:30+00:00") == (None, {})


# -- what people see ---------------------------------------------------------------------------------------------

def _summary(price=None):
    book = usage.ledger(TWO_WORKERS, released_at=70)
    made = summarize(book, price=price, tokens=10_000, efficiency=0.7)
    return replace(made, workers=2, attempts=(AttemptRow("train", 1, "1", "succeeded", 2),)).to_xcom()


def test_the_report_has_a_gpu_time_section_with_the_line_causes_and_chart():
    from tasks.report.markdown import markdown
    from tasks.report.view import report_view

    release = {"clean": True, "usage": _summary(freeze(use_gpu=False)), "charts": {"usage": "usage.png"}}
    md = markdown(report_view(view_of(base_report(), None, release)))
    section = md.split("## GPU time and cost")[1].split("\n## ")[0]
    assert "2 worker slots held 0.0389 worker-h (0.001944 EUR at 0.05 EUR/worker-h, on_demand): 29% training" in section
    assert "| training (busy) | 0.0111 | 28.6% |" in section and "| release |" in section
    assert "1.43x the worker-hours per token of one worker" in section and "![usage](usage.png)" in section
    assert "usage.png" not in md.split("## Charts")[1]  # shown once, in its section
    unpriced = markdown(report_view(view_of(base_report(), None, {"clean": True, "usage": _summary()})))
    assert "no price: cost not shown" in unpriced and "GPT_FINETUNE_PRICING" in unpriced
    assert "GPU time and cost" not in markdown(report_view(view_of(base_report(), None, {"clean": True})))


def test_the_runs_page_shows_held_busy_cost_and_time_to_release():
    from gpt_finetune_ui.report_pages import render_index
    from gpt_finetune_ui.runs_data import headline

    base = base_report(baseline=False)
    priced = headline("k", view_of(base, None, {"clean": True, "usage": _summary(freeze(use_gpu=False))}))
    assert (priced["held_gpu_h"], priced["currency"], priced["time_to_release_s"]) == (0.038889, "EUR", 5.0)
    old = headline("k2", view_of(base))  # a report from before the ledger lists with blanks
    assert old["held_gpu_h"] is None and old["cost"] is None
    page = render_index([{**priced, "released": "yes"}, {**old, "released": "yes"}], "/root")
    assert "<th>GPU-h held</th><th>busy</th><th>cost</th>" in page
    assert "<td>0.039</td><td>29%</td><td>0.001944 EUR</td><td>5.0 s</td>" in page
    assert "<td>—</td><td>—</td><td></td><td>—</td>" in page  # no cost: blank, never 0


def test_cost_warnings_name_the_live_idle_warnings_the_top_cause_and_the_cheapest_count():
    """Never failures: each idle-held warning raised while a group ran (tests/tasks/ledger/test_idle.py), a mostly
    idle run of at least one held hour, efficiency below min_cost_efficiency naming the advisor's cheapest count, a
    slow release."""
    from tasks.ledger.record import cost_warnings

    book = usage.ledger([attempt("train", rank(0, 0, 2000, 9000, 2100, 3000), rank(1, 0, 5, 9000, 2100, 3000))],
                        released_at=9100)
    live = IdleWarning(at="1970-01-01T00:10:00.000Z", ranks=(0,), slots=("h/rank0",), idle_s=950.0,
                       phase={"0": "after step 2"}, peak_util_pct=None,
                       text="GPU time: train (attempt 1) held 1 slot(s) ['h/rank0'] ...")
    summary = replace(summarize(book, price=None, efficiency=0.3), workers=2, cheapest_workers=1,
                      idle_warnings=(LiveWarning("train", 1, live),))
    found = cost_warnings(summary, {"max_idle_held_s": 900, "min_cost_efficiency": 0.5, "max_release_s": 60})
    assert len(found) == 4, found
    assert found[0] == live.text
    assert "more than max_release_s = 60 s" in found[1]
    assert "mostly idle" in found[2] and "largest idle cause is export" in found[2]
    assert "3.3x the worker-hours per token of one" in found[3] and "cheapest count is 1" in found[3]
    assert cost_warnings(replace(summary, idle_warnings=()),
                         {"max_idle_held_s": 0, "min_cost_efficiency": 0, "max_release_s": 0}) == \
        [found[2]]  # 0 turns each setting's warning off; the mostly idle run has no setting


def test_the_advisors_cheapest_count_is_read_checked_from_preflight_json(tmp_path, caplog):
    from core.storage import write_json_atomic
    from tasks.ledger.record import _cheapest_workers

    report_url = str(tmp_path / "report")
    assert _cheapest_workers(report_url) is None  # no preflight.json
    write_json_atomic(f"{report_url}/preflight.json", {"advisor": {"cost": {"cheapest_workers": 2}}})
    assert _cheapest_workers(report_url) == 2
    write_json_atomic(f"{report_url}/preflight.json", {"advisor": {"cost": {"skipped": "the run has no price"}}})
    assert _cheapest_workers(report_url) is None
    write_json_atomic(f"{report_url}/preflight.json", {"advisor": {"cost": {"cheapest_workers": "two"}}})
    assert _cheapest_workers(report_url) is None
    assert "preflight.json: advisor.cost.cheapest_workers: expected" in caplog.text
