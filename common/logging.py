"""One `init_logger()` for every command: stdlib logging, rank 0 only, one dense line per event."""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "dflash"
LEVEL_ENV = "DFLASH_LOG_LEVEL"  # e.g. DEBUG: adds the shard writers' timeline to the log


def global_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def init_logger(level: int = logging.INFO) -> logging.Logger:
    """Configure the `dflash` logger: INFO (or $DFLASH_LOG_LEVEL) on rank 0 to stderr, warnings
    only on other ranks."""
    if os.environ.get(LEVEL_ENV):
        name = os.environ[LEVEL_ENV].upper()
        if not isinstance(logging.getLevelName(name), int):
            raise ValueError(f"{LEVEL_ENV}={name!r} is not a level; use DEBUG, INFO or WARNING")
        level = logging.getLevelName(name)
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        rank = global_rank()
        prefix = f"[rank {rank}] " if rank else ""
        handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level if global_rank() == 0 else logging.WARNING)
    if level > logging.DEBUG:
        quiet_import_noise()
    return logger


# Warnings that importing an installed torchao prints on every command (transformers imports
# it when loading any model), none of them about this run: its optional C++ kernels are built
# for another CUDA (float8 training does not use them), and torch deprecates how it registers
# two enums. (logger name, a phrase of the message)
IMPORT_NOISE = (
    ("torchao", "Failed to load "),
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class _DropPhrase(logging.Filter):
    def __init__(self, phrase: str) -> None:
        super().__init__()
        self.phrase = phrase

    def filter(self, record: logging.LogRecord) -> bool:
        return self.phrase not in record.getMessage()


def quiet_import_noise() -> None:
    """Drop IMPORT_NOISE's records (DFLASH_LOG_LEVEL=DEBUG keeps them)."""
    for name, phrase in IMPORT_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPhrase) and f.phrase == phrase for f in logger.filters):
            logger.addFilter(_DropPhrase(phrase))


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)


def quiet_launcher_logs() -> None:
    """Silence torchrun's launcher below DEBUG: it logs every failed worker's traceback (and its
    peers' consequences) at ERROR, while the command reports the worker's own error in one
    line (common/errors.py). Imports the launcher so its loggers exist to be lowered."""
    if get_logger().getEffectiveLevel() <= logging.DEBUG:
        return
    import torch.distributed.launcher.api  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
