"""Server-sent events as the OpenAI streaming API frames them.

Each event is one ``data: <json>`` line and a blank line; the stream ends with ``data: [DONE]``.
An error after the stream has started cannot change the HTTP status any more, so it is sent as
an event whose JSON holds an ``error`` object: the official client raises it as an APIError.
"""

from __future__ import annotations

import json
from typing import Any

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
#: Headers that keep proxies from buffering the stream (nginx honours X-Accel-Buffering).
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event. Compact JSON on one line: JSON escapes newlines inside strings."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
