"""Errors of the data layer."""

from __future__ import annotations

SHOWN_CHARS = 40


class DataFormatError(ValueError):
    """A malformed input row; the message names the file, the 1-based line and what was expected."""


def shown(text: object, limit: int = SHOWN_CHARS) -> str:
    """``repr`` of a value from a data file, cut to a readable length (a row may hold a field of
    thousands of characters; the error stays one short line)."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[: limit - 12]}...{r[-6:]} ({len(r):,} characters)"
