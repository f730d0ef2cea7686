"""init_logger (and `python -m common.tiny`) drop the import-time noise of an installed
torchao, and only that."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

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


def test_the_tiny_target_script_drops_the_noise_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """scripts/example.sh's first command, `python -m common.tiny`, printed torchao's "Failed to
    load ..._C_mxfp8.so" and torch's Enum deprecations before anything of the example."""
    from common import tiny

    for name, _ in IMPORT_NOISE:  # as in a fresh process: no dflash command ran before
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    monkeypatch.setattr(sys, "argv", ["tiny", str(tmp_path / "target")])
    tiny.main()
    for name, phrase in IMPORT_NOISE:
        record = logging.LogRecord(name, logging.WARNING, "", 0, f"x {phrase} y", None, None)
        assert not logging.getLogger(name).filter(record), name
