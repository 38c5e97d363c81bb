"""The error raised when a packaged data set is not installed."""

from __future__ import annotations


class DataUnavailable(RuntimeError):
    """A data set is not installed here; the message says how to install it."""
