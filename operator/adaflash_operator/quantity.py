"""Kubernetes resource quantities ("200Gi", "1.5T", "500m") as exact numbers (pure).

The operator compares sizes the way the API server does: a claim grows when the spec asks for
more than it has, and "1024Mi" equals "1Gi". Only the suffixes the CRD admits for sizes and
the decimal ones of the API are accepted; anything else is a ValueError that names the value.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": 1,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_FORM = re.compile(r"^([+-]?[0-9]*\.?[0-9]+|[+-]?[0-9]+\.)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|"
                   r"[eE][+-]?[0-9]+)?$")


def parse(value: str | int | float) -> Fraction:
    """The quantity's value in base units (bytes, cores...)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity")
    if isinstance(value, (int, float)):
        return Fraction(value)
    m = _FORM.match(str(value).strip())
    if m is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 200Gi, 1.5T, 500m)")
    number, suffix = Fraction(m.group(1)), m.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix[:1] in ("e", "E"):
        return number * Fraction(10) ** int(suffix[1:])
    return number * _DECIMAL[suffix]


def larger(a: str, b: str) -> str:
    """Whichever of two quantities is larger (`a` when they are equal), as written."""
    return b if parse(b) > parse(a) else a
