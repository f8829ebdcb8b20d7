"""The advisor's cost columns (trainer/advisor.py cost_columns, budget_error; trainer/preflight/advice.py
cost_advice): estimated hours and cost per worker count from the frozen price and the last comparable run's fixed
overhead, the cheapest and the fastest-within-budget picks, the budget gate, and the reasons to skip."""

from __future__ import annotations

import pytest

from core.config import RunConfig
from core.storage import join, write_json_atomic
from trainer import advisor
from trainer.preflight.advice import cost_advice, last_comparable_usage

# Predicted step times of 1..4 workers: 2 is nearly twice as fast as 1, 3 and 4 add little.
STEPS = {1: 1.0, 2: 0.52, 3: 0.45, 4: 0.42}


def rows():
    return [{"num_workers": n, "step_time_s": t, "step_time_overlap_s": t, "tokens_per_s": 1000 / t,
             "speedup": STEPS[1] / t, "efficiency": STEPS[1] / t / n, "efficiency_overlap": STEPS[1] / t / n}
            for n, t in STEPS.items()]


def test_cost_columns_estimate_hours_and_cost_and_name_the_two_picks():
    table = rows()
    picks = advisor.cost_columns(table, steps=3600, tokens_per_step=1000, rate=2.0, overhead_s=60)
    two = table[1]
    assert two["est_hours"] == pytest.approx((60 + 3600 * 0.52) / 3600)
    assert two["est_cost"] == pytest.approx(2 * two["est_hours"] * 2.0)
    assert two["cost_per_mtoken"] == pytest.approx(two["est_cost"] / 3.6)
    assert picks == {"cheapest_workers": 1, "fastest_workers": 4, "budget": 0.0}
    # a budget that 4 workers exceed (4 x 0.437 h x 2 = 3.5) but 2 do not (2 x 0.537 x 2 = 2.15)
    assert advisor.cost_columns(rows(), steps=3600, tokens_per_step=1000, rate=2.0, overhead_s=60,
                                budget=2.5)["fastest_workers"] == 2


def test_cheapest_is_the_larger_count_when_overhead_dominates():
    """A long fixed overhead is paid once per worker: fewer, longer workers no longer win."""
    picks = advisor.cost_columns([{"num_workers": 1, "step_time_s": 1.0}, {"num_workers": 2, "step_time_s": 0.5}],
                                 steps=100, tokens_per_step=1, rate=1.0, overhead_s=0)
    assert picks["cheapest_workers"] == 1  # a tie on cost: fewer workers


def _advice(asked, budget):
    table = rows()
    picks = advisor.cost_columns(table, steps=3600, tokens_per_step=1000, rate=2.0, overhead_s=60, budget=budget)
    cost = {**picks, "rate": 2.0, "currency": "EUR", "unit": "gpu-hour", "overhead_s": 60, "overhead_from": "r0"}
    return {"rows": table, "asked": {"num_workers": asked}, "recommendation": "r", "cost": cost}


def test_preflight_fails_when_the_asked_count_is_predicted_over_the_budget():
    error = advisor.budget_error(_advice(4, 2.5))
    assert "4 workers are predicted to cost 3.493 EUR" in error and "'max_run_cost' = 2.5" in error
    assert "2 workers are the fastest within it, 1 the cheapest" in error and "est. cost" in error
    assert advisor.budget_error(_advice(2, 2.5)) is None
    assert advisor.budget_error(_advice(4, 0)) is None  # no budget


def _cfg(tmp_path, **changes):
    return RunConfig.of(storage_root=str(tmp_path), max_steps=3600, num_workers=4, **changes)


def _earlier(tmp_path, key="earlier", **config):
    usage = {"slots": 2, "idle_by_cause_gpu_h": {"startup": 40 / 3600, "compile": 20 / 3600, "release": 1.0}}
    write_json_atomic(join(str(tmp_path), "runs", key, "report", "report.json"), {
        "run_id": key, "created_at": "2026-01-01T00:00:00", "usage": usage,
        "config": {"model": "tiny", "block_size": 64, "backend": "local", "use_gpu": False, **config}})


def test_cost_advice_uses_the_frozen_price_and_the_last_comparable_overhead(tmp_path):
    cfg = _cfg(tmp_path, max_run_cost=2.5)
    own = join(str(tmp_path), "runs", "now")
    write_json_atomic(join(own, "usage", "price.json"), {"price": {
        "currency": "EUR", "capacity": "on_demand", "unit": "worker_hour", "default": 2.0, "rates": {}, "source": "t"}})
    _earlier(tmp_path)
    _earlier(tmp_path, key="other-model", model="small")  # not comparable
    advice = {"rows": rows(), "asked": {"num_workers": 4}}
    cost = cost_advice(cfg, advice, config_url=join(own, "config.json"), reports={})
    assert cost["overhead_s"] == pytest.approx(30)  # (40 + 20) s over 2 slots; release is not a fixed overhead
    assert cost["overhead_from"] == "earlier" and cost["rate"] == 2.0
    assert cost["cheapest_workers"] == 1 and cost["budget"] == 2.5
    assert advisor.budget_error({**advice, "cost": cost, "recommendation": "r"}) is not None


def test_cost_advice_says_why_it_skips(tmp_path):
    cfg = _cfg(tmp_path)
    own = join(str(tmp_path), "runs", "now")
    advice = {"rows": rows(), "asked": {"num_workers": 4}}
    assert "no price" in cost_advice(cfg, advice, config_url=join(own, "config.json"), reports={})["skipped"]
    write_json_atomic(join(own, "usage", "price.json"), {"price": {
        "currency": "EUR", "capacity": "on_demand", "unit": "worker_hour", "default": 2.0, "rates": {}, "source": "t"}})
    # an earlier run from before the ledger: a report without usage
    write_json_atomic(join(str(tmp_path), "runs", "old", "report", "report.json"),
                      {"run_id": "old", "created_at": "2025-01-01", "config": {"model": "tiny", "block_size": 64,
                                                                                "backend": "local", "use_gpu": False}})
    skipped = cost_advice(cfg, advice, config_url=join(own, "config.json"), reports={})["skipped"]
    assert "has a GPU-time ledger" in skipped and "overhead is unknown" in skipped
    assert last_comparable_usage(cfg, own) is None
    assert "est_cost" not in advice["rows"][0]
    lines = advisor.table_lines({"rows": rows(), "recommendation": "r", "cost": {"skipped": skipped}})
    assert lines[-1] == f"cost: not estimated: {skipped}" and "est. cost" not in lines[0]
