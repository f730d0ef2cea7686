"""The dflash logger's messages in tests: it does not propagate to pytest's caplog."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from common.logging import get_logger


@contextmanager
def dflash_messages(level: int = logging.NOTSET) -> Iterator[list[str]]:
    """The messages the dflash logger emits at `level` and above while the block runs."""
    seen: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    get_logger().addHandler(handler)
    try:
        yield seen
    finally:
        get_logger().removeHandler(handler)
