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

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from core.config import ConfigError, schema
from core.document import Document, DocumentError

PRICING_ENV = "GPT_FINETUNE_PRICING"
CAPACITIES = schema.CAPACITIES
UNITS = ("gpu_hour", "worker_hour")
RATE_SECTIONS = ("default", "cpu_worker")
OVERRIDES = ("backends", "queues")


def _fail(where: str, problem: str) -> ConfigError:
    return ConfigError(f"{PRICING_ENV}: {where}: {problem}. Fix the operator's pricing table (or unset "
                       f"{PRICING_ENV}: cost is then not shown).")


def _is_rate(rate: object) -> bool:
    return not isinstance(rate, bool) and isinstance(rate, int | float) and math.isfinite(rate) and rate >= 0


@dataclass(frozen=True)
class Prices:
    """The rates of a table or of one of its overrides: `default` and `cpu_worker` by capacity, `accelerators` by
    NVML device name, then by capacity."""

    default: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu_worker: dict[str, float] = dataclasses.field(default_factory=dict)
    accelerators: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def over(self, base: Prices) -> Prices:
        """These rates over `base`'s: each capacity this section names replaces base's, the others stay."""
        names = dict.fromkeys([*base.accelerators, *self.accelerators])  # the table's order, then the override's
        return Prices({**base.default, **self.default}, {**base.cpu_worker, **self.cpu_worker},
                      {name: {**base.accelerators.get(name, {}), **self.accelerators.get(name, {})} for name in names})


@dataclass(frozen=True)
class PriceTable:
    """The operator's table, checked (`parse_table`): its prices, and the overrides per backend and per queue."""

    currency: str
    prices: Prices
    backends: dict[str, Prices]
    queues: dict[str, Prices]


def _rates(where: str, rates: object) -> dict[str, float]:
    if not isinstance(rates, dict):
        raise _fail(where, f"expected an object of rates by capacity ({', '.join(CAPACITIES)}), got {rates!r}")
    for capacity, rate in rates.items():
        if capacity not in CAPACITIES:
            raise _fail(f"{where}.{capacity}", f"unknown capacity; one of {', '.join(CAPACITIES)}")
        if not _is_rate(rate):
            raise _fail(f"{where}.{capacity}", f"rate {rate!r} is not a number >= 0")
    return dict(rates)


def _prices(where: str, section: object, *, top: bool = False) -> Prices:
    """A table's or an override's rates: `default`, `cpu_worker`, `accelerators` (the table's own top level also
    carries `currency`, the overrides and an optional `billing_increment_s`, which no price uses)."""
    if not isinstance(section, dict):
        raise _fail(where, f"expected an object, got {section!r}")
    for key in section:
        if key not in (*RATE_SECTIONS, "accelerators") and not (top and key in ("currency", "billing_increment_s",
                                                                                 *OVERRIDES)):
            raise _fail(f"{where}{key}", "unknown key")
    accelerators = section.get("accelerators", {})
    if not isinstance(accelerators, dict):
        raise _fail(f"{where}accelerators", "expected an object of rates by accelerator name")
    return Prices(*(_rates(f"{where}{key}", section[key]) if key in section else {} for key in RATE_SECTIONS),
                  {name: _rates(f"{where}accelerators.{name}", rates) for name, rates in accelerators.items()})


def parse_table(text: str, source: str) -> PriceTable:
    """The table, checked: JSON, a currency, rates that are numbers >= 0; else ConfigError naming the place."""
    try:
        table = json.loads(text)
    except ValueError as error:
        raise _fail(source, f"not JSON ({error})") from error
    if not isinstance(table, dict):
        raise _fail(source, "expected a JSON object")
    if not isinstance(table.get("currency"), str) or not table["currency"].strip():
        raise _fail("currency", f"expected a currency code such as \"EUR\", got {table.get('currency')!r}")
    prices = _prices("", table, top=True)
    overrides = {}
    for kind in OVERRIDES:
        named = table.get(kind, {})
        if not isinstance(named, dict):
            raise _fail(kind, "expected an object of overrides by name")
        overrides[kind] = {name: _prices(f"{kind}.{name}.", section) for name, section in named.items()}
    return PriceTable(table["currency"], prices, **overrides)


def table_from_env(environ: Mapping[str, str] | None = None) -> tuple[PriceTable | None, str | None]:
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


@dataclass(frozen=True)
class Price(Document):
    """The price a run keeps (`freeze`): in the prepared run's XCom (`price`) and in `usage/price.json`
    (`{"price": PRICE | null}`, tasks/ledger/record.py), read back by release's ledger.

    Attributes:
        currency: the table's currency; capacity: the run's `capacity` (on_demand, reserved, spot).
        unit: `gpu_hour` (a rate per accelerator-hour) or `worker_hour` (a CPU run: per worker-hour).
        default: the rate of an accelerator `rates` does not name (of a CPU worker for `worker_hour`); None when
            the table has accelerator rates only.
        rates: the rate per NVML device name (empty for `worker_hour`).
        source: where the table came from, and the overrides applied (`queues.q > backends.b > table`).
    """

    currency: str
    capacity: str
    unit: str
    default: float | None
    rates: dict[str, float]
    source: str

    def __post_init__(self) -> None:
        """Checked on every reading too (XCom, price.json): a rate is a number >= 0, unit and capacity known."""
        if self.unit not in UNITS:
            raise DocumentError(f"Price.unit: {self.unit!r} is none of {', '.join(UNITS)}: refusing the price.")
        if self.capacity not in CAPACITIES:
            raise DocumentError(f"Price.capacity: {self.capacity!r} is none of {', '.join(CAPACITIES)}: refusing "
                                "the price.")
        for where, rate in (("default", self.default), *((f"rates.{n}", r) for n, r in self.rates.items())):
            if rate is not None and not _is_rate(rate):
                raise DocumentError(f"Price.{where}: {rate!r} is not a rate >= 0: refusing the price.")

    def rate_for(self, accelerator: str | None) -> tuple[float | None, str | None]:
        """The hourly rate for this accelerator, and a note when the table's default stood in."""
        if self.unit == "worker_hour" or not accelerator:
            return self.default, None
        if accelerator in self.rates:
            return self.rates[accelerator], None
        return self.default, (f"no rate for accelerator {accelerator!r} in the pricing table: its default rate "
                              f"{self.default} was used")


def freeze(table: PriceTable | None, source: str | None, *, backend: str, queue: str, capacity: str,
           use_gpu: bool) -> Price | None:
    """The price a run keeps (a later change of the table does not rewrite it): unit, the rate per accelerator
    name and the default for the run's capacity, after the backend's and the queue's overrides; None without a
    table, or when the table has no rate for this capacity."""
    if table is None:
        return None
    prices, applied = table.prices, []
    for kind, overrides, name in (("backends", table.backends, backend), ("queues", table.queues, queue)):
        if name and name in overrides:
            prices = overrides[name].over(prices)
            applied.append(f"{kind}.{name}")
    default = (prices.default if use_gpu else prices.cpu_worker).get(capacity)
    rates = {name: r[capacity] for name, r in prices.accelerators.items() if capacity in r}
    if default is None and not (use_gpu and rates):
        return None
    return Price(currency=table.currency, capacity=capacity, unit="gpu_hour" if use_gpu else "worker_hour",
                 default=default, rates=rates if use_gpu else {},
                 source=f"{source}" + (f" ({' > '.join(reversed(applied))} > table)" if applied else ""))
