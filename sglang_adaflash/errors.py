"""The one error type every user-facing entry point shares.

It sits at the bottom of the package so that the CLI, `serve`, `bench`, the demo and D2SD's
option parsing can all raise it without importing one another.
"""

from __future__ import annotations


class CLIError(Exception):
    """A problem with the command line or its inputs; printed as one line, exit code 2."""
