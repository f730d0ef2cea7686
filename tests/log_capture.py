"""The dflash logger's messages in tests: it does not propagate to pytest's caplog."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from common.logging import get_logger


@contextmanager
def dflash_messages(level: int = logging.NOTSET) -> Iterator[list[str]]:
    """The messages the dflash logger emits at `level` and above while the block runs; a
    `level` below the logger's own lowers the logger to it for the block (as `init_logger`
    sets INFO in a command), so that INFO lines are seen in tests where no command ran."""
    seen: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = get_logger()
    own_level = logger.level
    if level != logging.NOTSET and level < logger.getEffectiveLevel():
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(own_level)
