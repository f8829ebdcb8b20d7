"""The operator's price table (`GPT_FINETUNE_PRICING`: inline JSON or the path of a JSON file) and the price a run
freezes at prepare: pure functions but `table_from_env`.

    {"currency": "EUR",
     "default": {"on_demand": 2.50},
     "accelerators": {"NVIDIA H200": {"on_demand": 3.80, "reserved": 2.10, "spot": 1.40}},
     "backends": {"kubernetes": {"accelerators": {"NVIDIA H200": {"on_demand": 4.10}}}},
     "queues": {"gpu_spot": {"default": {"spot": 1.20}}},
     "cpu_worker": {"on_demand": 0.05}}

Rates are per accelerator-hour (per worker-hour for `cpu_worker`), by capacity (`on_demand`, `reserved`, `spot`).
A run's queue overrides its backend, which overrides the table (deep-merged). The accelerator is the NVML device
name the training summary records; one the table does not list gets `default`. No table: no price, cost null.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, schema

PRICING_ENV = "GPT_FINETUNE_PRICING"
CAPACITIES = schema.choices("capacity")
RATE_SECTIONS = ("default", "cpu_worker")
OVERRIDES = ("backends", "queues")


def _fail(where: str, problem: str) -> ConfigError:
    return ConfigError(f"{PRICING_ENV}: {where}: {problem}. Fix the operator's pricing table (or unset "
                       f"{PRICING_ENV}: cost is then not shown).")


def _check_rates(where: str, rates: Any) -> None:
    if not isinstance(rates, dict):
        raise _fail(where, f"expected an object of rates by capacity ({', '.join(CAPACITIES)}), got {rates!r}")
    for capacity, rate in rates.items():
        if capacity not in CAPACITIES:
            raise _fail(f"{where}.{capacity}", f"unknown capacity; one of {', '.join(CAPACITIES)}")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate < 0:
            raise _fail(f"{where}.{capacity}", f"rate {rate!r} is not a number >= 0")


def _check_prices(where: str, section: Any) -> None:
    """A table's or an override's rates: `default`, `cpu_worker`, `accelerators`."""
    if not isinstance(section, dict):
        raise _fail(where, f"expected an object, got {section!r}")
    for key, value in section.items():
        if key in RATE_SECTIONS:
            _check_rates(f"{where}{key}", value)
        elif key == "accelerators":
            if not isinstance(value, dict):
                raise _fail(f"{where}accelerators", "expected an object of rates by accelerator name")
            for name, rates in value.items():
                _check_rates(f"{where}accelerators.{name}", rates)
        elif not (where == "" and key in ("currency", "billing_increment_s", *OVERRIDES)):
            raise _fail(f"{where}{key}", "unknown key")


def parse_table(text: str, source: str) -> dict[str, Any]:
    """The table, checked: JSON, a currency, rates that are numbers >= 0; else ConfigError naming the place."""
    try:
        table = json.loads(text)
    except ValueError as error:
        raise _fail(source, f"not JSON ({error})") from error
    if not isinstance(table, dict):
        raise _fail(source, "expected a JSON object")
    if not isinstance(table.get("currency"), str) or not table["currency"].strip():
        raise _fail("currency", f"expected a currency code such as \"EUR\", got {table.get('currency')!r}")
    _check_prices("", table)
    for kind in OVERRIDES:
        overrides = table.get(kind, {})
        if not isinstance(overrides, dict):
            raise _fail(kind, "expected an object of overrides by name")
        for name, section in overrides.items():
            _check_prices(f"{kind}.{name}.", section)
    return table


def table_from_env(environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """(the table, where it came from), or (None, None) when the operator set none."""
    value = (os.environ if environ is None else environ).get(PRICING_ENV, "").strip()
    if not value:
        return None, None
    if value.startswith("{"):
        return parse_table(value, f"${PRICING_ENV}"), f"${PRICING_ENV}"
    try:
        text = Path(value).read_text(encoding="utf-8")
    except OSError as error:
        raise _fail(value, f"cannot read the file ({error})") from error
    return parse_table(text, value), value


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def freeze(table: Mapping[str, Any] | None, source: str | None, *, backend: str, queue: str, capacity: str,
           use_gpu: bool) -> dict[str, Any] | None:
    """The price a run keeps (a later change of the table does not rewrite it): unit, the rate per accelerator
    name and the default for the run's capacity, after the backend's and the queue's overrides; None without a
    table, or when the table has no rate for this capacity."""
    if table is None:
        return None
    merged, applied = {k: v for k, v in table.items() if k not in OVERRIDES}, []
    for kind, name in (("backends", backend), ("queues", queue)):
        if name and name in table.get(kind, {}):
            merged = _merge(merged, table[kind][name])
            applied.append(f"{kind}.{name}")
    section = "default" if use_gpu else "cpu_worker"
    default = (merged.get(section) or {}).get(capacity)
    rates = {name: r[capacity] for name, r in (merged.get("accelerators") or {}).items() if capacity in r}
    if default is None and not (use_gpu and rates):
        return None
    return {"currency": table["currency"], "capacity": capacity, "unit": "gpu_hour" if use_gpu else "worker_hour",
            "default": default, "rates": rates if use_gpu else {},
            "source": f"{source}" + (f" ({' > '.join(reversed(applied))} > table)" if applied else "")}
