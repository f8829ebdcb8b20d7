"""The GPU-time ledger of a run: pure functions over the launch path's events (no I/O; `tasks/usage_record.py`
reads and writes).

A slot is what a run holds: a GPU (host, device), or on a CPU run a worker place (host, rank). An attempt of a
group (`kind` train, baseline, preflight, evaluate) has per rank the events `launch`, `ready`, `first_step_end`,
`last_step_end`, `redone_after` and `exit`, all seconds on the launcher's clock (a group's events share one clock).

- held(g) = from the first launch on g to `released_at` (release's proof that it is free);
- busy(g) = the timed training steps on g (first step end -> last step end of train and baseline attempts), less
  the steps an attempt trained past the next attempt's resume point (`redone_after` -> last step end: redone);
- idle(g) = held(g) - busy(g), split into exactly one cause per second: each second of the held window takes the
  highest-ranked label of the segments covering it (`PRIORITY`); a second no segment covers is `between_tasks`
  before the slot's last exit and `release` after it.

When `released_at` comes before a worker's exit (release ran on another host whose clock is behind), the window
ends at the last exit instead and `clock_skew_s` says by how much.

Time a GPU task of the run waited for admission (`not_held`: Airflow's scheduled -> queued of each try,
tasks/airflow_api.py) is not held: no slot was the run's then. A second of a slot's window that no segment covers,
before its last exit (between tasks), and that lies in such a wait, is `waited`: left out of held (and so of idle
and every cause) and counted apart, costing nothing. Waits outside the window (before the first launch) are outside
held anyway; a second is never both waited and held.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CAUSES = ("between_tasks", "startup", "stragglers", "preflight", "compile", "redone", "evaluation", "export",
          "release", "other")
# Where segments overlap (groups of different launcher clocks, a rank's events out of order), the first listed wins.
PRIORITY = ("busy", "redone", "compile", "export", "preflight", "evaluation", "stragglers", "startup", "other")
AFTER_READY = {"preflight": "preflight", "evaluate": "evaluation"}  # kinds without steps: what follows the join
STEP_KINDS = ("train", "baseline")


def _segments_of_rank(kind: str, rank: Mapping[str, Any], group_ready: float | None) -> list[tuple[float, float,
                                                                                                   str]]:
    """(start, end, label) of one rank of one attempt."""
    launch, ready, end = rank["launch"], rank.get("ready"), rank["exit"]
    if ready is None:  # never joined: all of it was start-up
        return [(launch, end, "startup")]
    joined = group_ready if group_ready is not None else end  # a peer that never joined kept this one waiting
    out = [(launch, ready, "startup"), (ready, joined, "stragglers")]
    if kind in AFTER_READY:
        return [*out, (joined, end, AFTER_READY[kind])]
    if kind not in STEP_KINDS:
        return [*out, (joined, end, "other")]
    first, last = rank.get("first_step_end"), rank.get("last_step_end")
    if first is None or last is None:  # ended before its first step
        return [*out, (joined, end, "compile")]
    redone = rank.get("redone_after")
    kept_until = last if redone is None else max(first, min(redone, last))
    return [*out, (joined, first, "compile"), (first, kept_until, "busy"), (kept_until, last, "redone"),
            (last, end, "export")]


def slots_of(rank: Mapping[str, Any]) -> list[str]:
    """The slots a rank held: its GPUs on its host, or (host, rank) when it had none."""
    host = rank.get("host") or "localhost"
    gpus = list(rank.get("gpus") or [])
    return [f"{host}/gpu{g}" for g in gpus] if gpus else [f"{host}/rank{rank['rank']}"]


def segments_by_slot(attempts: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[float, float, str]]]:
    by_slot: dict[str, list[tuple[float, float, str]]] = {}
    for attempt in attempts:
        ranks = attempt["ranks"]
        readies = [r.get("ready") for r in ranks]
        group_ready = max(readies) if readies and None not in readies else None
        for rank in ranks:
            for slot in rank.get("slots") or slots_of(rank):
                by_slot.setdefault(slot, []).extend(_segments_of_rank(attempt["kind"], rank, group_ready))
    return by_slot


def _label_at(segments: Sequence[tuple[float, float, str]], a: float, b: float) -> str | None:
    covering = {label for start, end, label in segments if start <= a and end >= b and end > start}
    return next((label for label in PRIORITY if label in covering), None)


def _waiting(not_held: Sequence[tuple[float, float]], a: float, b: float) -> bool:
    return any(start <= a and end >= b for start, end in not_held)


def slot_ledger(segments: Sequence[tuple[float, float, str]], released_at: float,
                not_held: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """held, busy, idle and idle by cause (seconds) of one slot, from its segments and the release time; `waited_s`:
    the seconds between tasks that lay in an admission wait (`not_held`), left out of held."""
    held_from = min(start for start, _, _ in segments)
    last_exit = max(end for _, end, _ in segments)
    held_until = max(released_at, last_exit)
    edges = [p for s in segments for p in s[:2]] + [p for w in not_held for p in w]
    points = sorted({held_from, held_until, *(p for p in edges if held_from < p < held_until)})
    seconds = dict.fromkeys(("busy", *CAUSES, "waited"), 0.0)
    stretch: dict[str, float] = {}  # the current stretch without step progress, by cause
    longest: dict[str, float] = {}
    for a, b in itertools.pairwise(points):
        label = _label_at(segments, a, b) or ("release" if b > last_exit else
                                              "waited" if _waiting(not_held, a, b) else "between_tasks")
        seconds[label] += b - a
        if label == "waited":
            continue
        stretch = {} if label == "busy" else {**stretch, label: stretch.get(label, 0.0) + b - a}
        if sum(stretch.values()) > sum(longest.values()):
            longest = dict(stretch)
    waited = seconds.pop("waited")
    held = held_until - held_from - waited
    busy = seconds.pop("busy")
    return {"held_s": held, "busy_s": busy, "idle_s": held - busy, "idle_by_cause_s": seconds, "waited_s": waited,
            "held_from": held_from, "last_exit": last_exit, "time_to_release_s": max(0.0, released_at - last_exit),
            "longest_idle_s": sum(longest.values()),
            "longest_idle_cause": max(longest, key=longest.__getitem__) if longest else None}


def ledger(attempts: Sequence[Mapping[str, Any]], released_at: float,
           not_held: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The run's ledger: per slot and summed (seconds), time to release (last exit of any worker to release's
    proof), and the clock skew when release's clock is behind the last exit. `not_held`: the run's admission waits
    (start, end), see the module doc."""
    slots = {slot: slot_ledger(segments, released_at, not_held)
             for slot, segments in sorted(segments_by_slot(attempts).items())}
    if not slots:
        return {"held_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "idle_by_cause_s": dict.fromkeys(CAUSES, 0.0),
                "waited_s": 0.0, "slots": {}, "time_to_release_s": None, "clock_skew_s": 0.0}
    last_exit = max(s["last_exit"] for s in slots.values())
    return {
        "held_s": sum(s["held_s"] for s in slots.values()),
        "busy_s": sum(s["busy_s"] for s in slots.values()),
        "idle_s": sum(s["idle_s"] for s in slots.values()),
        "idle_by_cause_s": {c: sum(s["idle_by_cause_s"][c] for s in slots.values()) for c in CAUSES},
        "waited_s": sum(s["waited_s"] for s in slots.values()),
        "slots": slots,
        "time_to_release_s": max(0.0, released_at - last_exit),
        "clock_skew_s": max(0.0, last_exit - released_at),
    }



def _hours(seconds: float) -> float:
    return round(seconds / 3600.0, 6)


def rate_for(price: Mapping[str, Any] | None, accelerator: str | None) -> tuple[float | None, str | None]:
    """The hourly rate of the frozen price for this accelerator, and a note when the table's default stood in."""
    if not price:
        return None, None
    if price["unit"] == "worker_hour" or not accelerator:
        return price.get("default"), None
    rates = price.get("rates") or {}
    if accelerator in rates:
        return rates[accelerator], None
    return price.get("default"), (f"no rate for accelerator {accelerator!r} in the pricing table: its default "
                                  f"rate {price.get('default')} was used")


def summarize(book: Mapping[str, Any], *, price: Mapping[str, Any] | None, accelerator: str | None = None,
              tokens: int | None = None, efficiency: float | None = None) -> dict[str, Any]:
    """release.json's `usage` from a ledger: hours, shares, and the cost when the run has a price (else null, never
    0). `tokens`: the tokens trained (for the cost per million); `efficiency`: the measured scaling efficiency,
    whence the extra cost of parallelism, busy cost x (1 - E)."""
    held, busy = book["held_s"], book["busy_s"]
    rate, note = rate_for(price, accelerator)
    cost = None
    if rate is not None:
        held_cost, busy_cost = held / 3600.0 * rate, busy / 3600.0 * rate
        cost = {"held": round(held_cost, 6), "busy": round(busy_cost, 6),
                "per_mtoken": round(held_cost / tokens * 1e6, 6) if tokens else None,
                "extra_for_parallelism": (round(busy_cost * (1 - efficiency), 6)
                                          if efficiency is not None else None)}
    return {
        "unit": (price or {}).get("unit") or ("gpu_hour" if any("/gpu" in s for s in book["slots"]) else
                                              "worker_hour"),
        "slots": len(book["slots"]),
        "held_gpu_h": _hours(held), "busy_gpu_h": _hours(busy), "idle_gpu_h": _hours(book["idle_s"]),
        "idle_by_cause_gpu_h": {cause: _hours(s) for cause, s in book["idle_by_cause_s"].items()},
        "busy_share": round(busy / held, 4) if held else None,
        "time_to_release_s": (round(book["time_to_release_s"], 3) if book["time_to_release_s"] is not None
                              else None),
        "clock_skew_s": round(book["clock_skew_s"], 3),
        "per_slot": [{"slot": slot, "held_h": _hours(s["held_s"]), "busy_h": _hours(s["busy_s"]),
                      "idle_h": _hours(s["idle_s"]), "longest_idle_s": round(s["longest_idle_s"], 3),
                      "longest_idle_cause": s["longest_idle_cause"]} for slot, s in book["slots"].items()],
        "efficiency": efficiency,
        "gpu_h_per_token_vs_one_worker": round(1 / efficiency, 3) if efficiency else None,
        "price": None if rate is None else {**{k: price[k] for k in ("currency", "capacity", "unit", "source")},
                                            "rate": rate, "note": note},
        "cost": cost,
    }
