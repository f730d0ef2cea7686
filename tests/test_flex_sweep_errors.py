"""bench/flex_sweep.py's record of a variant that fails: the cause, not only a banner."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from flex_sweep import _short  # noqa: E402


def test_a_lowering_error_keeps_its_cause_past_the_banner() -> None:
    """The flash backend's error opened with a line of '=' and named its cause below it; the
    record kept the banner alone (forty-first session)."""
    banner = "=" * 80
    err = RuntimeError(
        f"CuteDSL template failed: {banner}\n{banner}\n  NotImplementedError: mask buffers "
        f"require grad\n\n{banner}\n"
    )
    record = _short(err)
    assert record == (
        "RuntimeError: CuteDSL template failed: ===="
        + "=" * 76
        + " | NotImplementedError: mask buffers require grad"
    ), record


def test_a_long_error_is_cut_at_4000_characters() -> None:
    assert len(_short(ValueError("x" * 10_000))) == len("ValueError: ") + 4000
