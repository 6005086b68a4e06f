"""The operator's clock and its timestamps in status (UTC, RFC 3339 to the second, as
rollout.parse_ts reads them)."""

from __future__ import annotations

import datetime as dt


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def ts(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
