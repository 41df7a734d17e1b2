"""Errors of the data layer."""


class DataFormatError(ValueError):
    """A malformed input row; the message names the file, the 1-based line and what was expected."""
