"""The operator's clock and its timestamps in status (UTC, RFC 3339, as rollout.parse_ts reads them)."""

from __future__ import annotations

import datetime as dt

from .rollout import _ts


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def ts(t: dt.datetime) -> str:
    return _ts(t)
