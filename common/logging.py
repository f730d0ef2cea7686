"""One `init_logger()` for every command: stdlib logging, rank 0 only, one dense line per event."""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "dflash"


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_logger(level: int = logging.INFO) -> logging.Logger:
    """Configure the `dflash` logger: INFO on rank 0 to stderr, warnings only on other ranks."""
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        rank = global_rank()
        prefix = f"[rank {rank}] " if rank else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level if global_rank() == 0 else logging.WARNING)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
