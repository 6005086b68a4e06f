"""Values that cross a trust boundary, checked one way for the server, the SGLang plugin and the CLI.

Three kinds of value arrive from outside (an HTTP body or header, a file on the shared volume, a
command line) and used to be checked in several places, each a little differently:

- **Drafter versions** (``v000001``): a version becomes a path under ``drafters/`` and a number
  that orders rollouts, so only ``v`` followed by at least six ASCII digits is one. Python's
  ``\\d`` also matches other scripts' digits (a directory named with fullwidth digits was read
  as a version), and ``$`` also matches before a trailing newline; neither is used here.
- **Opt-out flags** (``metadata.adaflash_no_log``, the ``x-adaflash-no-log`` header): one set of
  spellings, :data:`TRUE_SPELLINGS` and :data:`FALSE_SPELLINGS`, compared without case and
  surrounding blanks. Anything else is an error, never a silent "no": a request that tried to
  keep itself out of the traffic records and misspelt it must learn so.
- **JSON bodies**: not JSON, not UTF-8, or nested deeper than the parser can follow (a body of
  100,000 ``[``) is one ValueError with a one-line reason, never a RecursionError.

This module imports nothing from the package, so every layer can use it.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: A drafter version: ``v`` and at least six ASCII digits (``re.ASCII``: no other script's digits).
VERSION_RE = re.compile(r"v([0-9]{6,})", re.ASCII)

#: Spellings of "yes" for an opt-out flag (strings are compared lower-cased and stripped).
TRUE_SPELLINGS = ("true", "1", "yes", "on")
#: Spellings of "no"; an absent value, JSON ``null`` and the empty string also mean no.
FALSE_SPELLINGS = ("false", "0", "no", "off", "")


class InvalidVersion(ValueError):
    """A value that is not a drafter version name."""


def is_version(value: object) -> bool:
    """Whether ``value`` is a version name such as ``v000001`` (any other type: False)."""
    return isinstance(value, str) and VERSION_RE.fullmatch(value) is not None


def version_number(value: object) -> int:
    """``"v000042"`` -> 42; raises :class:`InvalidVersion` saying what a version looks like."""
    m = VERSION_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        shown = repr(value) if isinstance(value, str) else f"a JSON {_json_type(value)} ({value!r:.40})"
        raise InvalidVersion(
            f"drafter version {shown} is not of the form v000001 (a 'v' and at least six ASCII "
            "digits, as published under drafters/ on the shared volume)")
    return int(m.group(1))


def parse_flag(value: object, what: str) -> bool:
    """An opt-out value -> bool. None (absent) is False; raises ValueError naming ``what``.

    JSON ``true``/``false``, the integers 1 and 0, and the strings in :data:`TRUE_SPELLINGS` and
    :data:`FALSE_SPELLINGS` (any case, surrounding blanks ignored) are understood.
    """
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_SPELLINGS:
            return True
        if word in FALSE_SPELLINGS:
            return False
    raise ValueError(
        f"{what} must be true or false (also 1/0, yes/no, on/off, in any case); got {value!r:.40}")


def parse_json_body(raw: bytes | str) -> Any:
    """Decode a JSON request body; raises ValueError with a one-line reason."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("the request body is nested too deeply to be read as JSON") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"the request body is not UTF-8 text (byte {e.start + 1}): send JSON "
                         "encoded as UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the request body is not valid JSON: {e}") from None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
