"""init_logger drops the import-time noise of an installed torchao, and only that."""

from __future__ import annotations

import logging

from common.logging import IMPORT_NOISE, init_logger


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_import_noise_is_dropped_and_other_warnings_kept() -> None:
    init_logger()
    init_logger()  # a second call adds no second filter
    for name, phrase in IMPORT_NOISE:
        logger = logging.getLogger(name)
        assert sum(phrase in getattr(f, "phrase", "") for f in logger.filters) == 1
        records = _Records()
        logger.addHandler(records)
        try:
            logger.warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
            logger.warning("%s is an Enum subclass and is now natively supported by ...", "<e>")
            logger.warning("a real problem")
        finally:
            logger.removeHandler(records)
        assert records.messages == [
            m
            for m in (
                "Failed to load /x/_C_mxfp8.so: Could not load this library",
                "<e> is an Enum subclass and is now natively supported by ...",
                "a real problem",
            )
            if phrase not in m
        ], name
