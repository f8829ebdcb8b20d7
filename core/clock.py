"""The one format of every record's timestamps."""

from __future__ import annotations

import time
from datetime import UTC, datetime


def utc_now() -> str:
    """Now, as every record's `*_at` field and log header holds it: ISO 8601 in UTC, to the millisecond
    (`2026-12-05T00:27:05.123+00:00`). Not whole seconds: durations are measured from these stamps (the GPU-time
    ledger's time to release, from release.json's `released_at`; the time after a run's last step, from its summary's
    `finished_at`)."""
    return utc_timestamp(time.time())


def utc_timestamp(seconds: float) -> str:
    """An instant, in seconds since the epoch, in `utc_now`'s format."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")
