"""Generated hostile inputs (issue 37, fuzz): the live-line reader, report.json for the UI's index and run page,
and the tokenize plan read back from storage. Cases come from `random.Random(seed)` (hypothesis is not a
dependency), a few hundred each, bounded to seconds. No input may write outside its directory, raise anything but
the project's named errors (or answer other than 200 / 404 / 422), or take more than linear time."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest

from tasks import telemetry
from trainer.metrics import LIVE_PREFIX

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugins"))  # as Airflow does for its plugins folder

ATOMS = [None, True, False, 0, -1, 1.5, 10 ** 400, "", "x", "<script>", "a\r\nb", "\x00", "é€😀", "NaN",
         float("inf"), [], {}]


def value(rng: random.Random, depth: int = 0):
    """A random JSON-ish value: scalars of every kind, lists and objects, now and then nested deep."""
    roll = rng.random()
    if depth > 6 or roll < 0.5:
        return rng.choice(ATOMS)
    if roll < 0.75:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["scope", "values", "loss", "step", "run_id", "runs", "distributed", "tokens_per_s", "samples", "x"]
    return {rng.choice(keys): value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def text_of(rng: random.Random, data) -> str:
    """JSON text for `data`, sometimes damaged: cut short, deep brackets, garbage, a huge string."""
    text = json.dumps(data, allow_nan=True, default=str) if not isinstance(data, int) or data < 10 ** 300 \
        else str(data)
    roll = rng.random()
    if roll < 0.1:
        return text[:rng.randint(0, len(text))]
    if roll < 0.15:
        return "[" * rng.randint(1, 200000)
    if roll < 0.2:
        return "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(0, 50)))
    if roll < 0.23:
        return json.dumps({"scope": "worker", "values": {"loss": 1.0}, "pad": "x" * rng.randint(1, 300000)})
    return text


# -- the live-line reader --------------------------------------------------------------------------------------

def test_the_live_line_reader_never_raises_and_stays_linear():
    rng = random.Random(37)
    reader = telemetry.LiveLineReader(run="r", task="train", enabled=True)
    reader.consume(0, LIVE_PREFIX + '{"scope": "worker", "values": {"loss": 1.0}}')  # imports Airflow's metrics
    started, slowest = time.perf_counter(), 0.0
    for case in range(600):
        data = value(rng) if rng.random() < 0.7 else {"scope": rng.choice(["worker", "release", "preflight", "x"]),
                                                      "values": value(rng)}
        line = (LIVE_PREFIX if rng.random() < 0.9 else "") + text_of(rng, data)
        began = time.perf_counter()
        assert reader.consume(rng.randint(0, 3), line) == line.startswith(LIVE_PREFIX), case
        slowest = max(slowest, time.perf_counter() - began)
        try:
            scope, values = telemetry.parse_live_line(line[len(LIVE_PREFIX):])
        except telemetry.MalformedLiveLine:
            continue
        assert isinstance(scope, str) and all(v is None or isinstance(v, float) for v in values.values())
    assert slowest < 0.5 and time.perf_counter() - started < 20


# -- report.json for the UI's index and run page ---------------------------------------------------------------

def mutate(rng: random.Random, report: dict) -> dict:
    """The good report with a few fields replaced by random values, at any depth."""
    report = json.loads(json.dumps(report))
    for _ in range(rng.randint(1, 4)):
        target, path = report, []
        while isinstance(target, dict) and target and rng.random() < 0.7:
            key = rng.choice(sorted(target))
            path.append(key)
            if not isinstance(target[key], dict):
                break
            target = target[key]
        if isinstance(target, dict) and path:
            target[path[-1]] = value(rng)
    return report


@pytest.fixture(scope="module")
def good_report() -> dict:
    from tests.tasks.report.test_store import report

    data = report("fuzz", 2, 0.5)
    data["samples"] = [{"model": name, "eval_loss": 5.0, "samples": [{"prompt": "p", "greedy": "g", "top_k": "k"}]}
                       for name in ("baseline", "distributed")]
    return data


def test_any_report_json_gives_an_index_and_never_a_500(tmp_path, good_report):
    from fastapi.testclient import TestClient
    from gpt_finetune_ui.reports_app import create_app

    rng = random.Random(9)
    runs = tmp_path / "storage" / "runs"
    keys = []
    for case in range(120):
        key = f"fuzz-{case}"
        data = mutate(rng, good_report) if rng.random() < 0.7 else value(rng)
        path = runs / key / "report" / "report.json"
        path.parent.mkdir(parents=True)
        path.write_text(text_of(rng, data) if rng.random() < 0.3 else json.dumps(data, allow_nan=True, default=str))
        for part in ("release.json", "promotion.json"):  # beside it, one writer each (tasks/report/parts.py)
            if rng.random() < 0.2:
                (runs / key / "report" / part).write_text(text_of(rng, value(rng)))
        keys.append(key)
    before = sorted(p for p in tmp_path.rglob("*"))
    client = TestClient(create_app(str(tmp_path / "storage")), raise_server_exceptions=False)
    began = time.perf_counter()
    assert client.get("/").status_code == 200
    rows = client.get("/api/runs").json()
    assert {row["run_key"] for row in rows} == set(keys)
    for key in keys:
        assert client.get(f"/runs/{key}/").status_code in (200, 422), key
    assert time.perf_counter() - began < 60
    assert sorted(p for p in tmp_path.rglob("*")) == before  # reading writes nothing


# -- the tokenize plan read back from storage ------------------------------------------------------------------

def test_a_generated_plan_or_lane_is_tokenized_as_planned_or_refused_by_name(tmp_path, monkeypatch):
    from tf_multiworker.backends import make_backend

    from core.document import DocumentError
    from tasks.dataset.errors import PrepareError
    from tasks.dataset.plan import DatasetPlan
    from tasks.prepare import plan_run, tokenize_lane
    from tests.tasks.dataset.corpus import two_part_corpus

    root = tmp_path / "allowed"
    corpus = two_part_corpus(root / "corpus")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("hunter2\n")
    monkeypatch.setenv("GPT_FINETUNE_DATA_ROOTS", str(root))
    params = {"storage_root": str(root / "storage"), "dataset": str(corpus / "*.txt"), "tokenizer": "bpe:300",
              "block_size": 32, "baseline": "skip", "prepare_tasks": 2, "prepare_unit_mb": 1}
    planned = plan_run(params, "manual__fuzz", "gpt_finetune", make_backend)
    planned = json.loads(json.dumps({"plan": planned.plan.to_xcom(), "lanes": planned.lanes_xcom()}))  # as XCom
    assert len(planned["lanes"]) == 2
    plan_path = Path(planned["plan"]["plan_url"])
    genuine = plan_path.read_text()
    hostile = [str(outside / "secret.txt"), str(outside), "/etc/passwd", "../../outside/secret.txt",
               "http://169.254.169.254/", "s3://other/x", "hf://datasets/evil@1/x.txt", "", None, -1, 1 << 62]
    rng = random.Random(5)
    refused = 0
    started = time.perf_counter()
    for case in range(60):
        plan = json.loads(genuine)
        job = plan["job"]
        where = rng.choice(["work_url", "tokenizer_dir", "source", "fingerprint", "plan_id", "lane", "sizes"])
        lane = json.loads(json.dumps(planned["lanes"][case % 2]))
        if where == "source":
            job["sources"][rng.randrange(len(job["sources"]))]["url"] = rng.choice(hostile)
        elif where == "sizes":
            job["sources"][0]["size"] = rng.choice(hostile)
        elif where == "lane":
            lane[0]["parts"][0][rng.choice(["file", "start", "end", "bytes"])] = rng.choice(hostile)
        elif where in ("fingerprint",):
            plan[where] = rng.choice(hostile)
        else:
            job[where] = rng.choice(hostile)
        plan_path.write_text(json.dumps(plan))
        summary = dict(planned["plan"])
        if rng.random() < 0.2:
            summary[rng.choice(["fingerprint", "plan_id"])] = rng.choice(hostile)
        try:  # a change that the lane does not read (another file's size) is harmless
            tokenize_lane(DatasetPlan.from_xcom(summary), lane)
        except (PrepareError, DocumentError):
            refused += 1
    plan_path.write_text(genuine)
    assert tokenize_lane(DatasetPlan.from_xcom(planned["plan"]), planned["lanes"][0]).units  # the genuine one
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]  # nothing written outside
    assert not [p for p in tmp_path.iterdir() if p.name not in ("allowed", "outside")]
    assert refused >= 50 and time.perf_counter() - started < 120
