"""A user's walk through nvfp4 stores (`store.hidden_dtype=nvfp4`): what the review of that
walk found wrong, each a test that failed before its fix."""

from __future__ import annotations

from pathlib import Path

from store_factory import FactorySpec, build_store
from test_convert import convert, import_store, write_input

IMPORT = (
    "--seq-len",
    "64",
    "--sequences-per-shard",
    "2",
    "--packing",
    "next_fit",
)  # import_store's


def test_import_refuses_other_options_naming_converts_own_flags(tmp_path: Path) -> None:
    """An import rerun with another --hidden-dtype (or --seq-len) was refused with extract's
    way out, `--set store.hidden_dtype=nvfp4` and `another --out`, flags convert has not: the
    refusal names convert's flags and the store's values, and a rerun with them resumes."""
    source = build_store(tmp_path / "source", FactorySpec(num_sequences=4))
    write_input(source, tmp_path / "in.h5", verifier=True, head=True)
    store = import_store(tmp_path / "in.h5", tmp_path / "store", "--hidden-dtype", "nvfp4")
    code, text = convert(tmp_path / "in.h5", store, *IMPORT, "--hidden-dtype", "float8_e4m3fn")
    text = " ".join(text.split())
    assert code == 2 and "--set" not in text and "--out" not in text, text
    assert "to resume it, rerun with --hidden-dtype nvfp4;" in text, text
    code, text = convert(tmp_path / "in.h5", store, "--hidden-dtype", "nvfp4")  # default packing
    text = " ".join(text.split())
    assert code == 2 and "rerun with --seq-len 64 --sequences-per-shard 2 --packing next_fit;" in (
        text
    ), text
    import_store(tmp_path / "in.h5", store, "--hidden-dtype", "nvfp4")  # the same: a no-op
    (tmp_path / "other.h5").write_bytes((tmp_path / "in.h5").read_bytes())
    code, text = convert(tmp_path / "other.h5", store, *IMPORT, "--hidden-dtype", "nvfp4")
    assert code == 2 and "resume" not in text and "--overwrite" in text, text
    code, text = convert(tmp_path / "in.h5", source, "--hidden-dtype", "nvfp4")
    assert code == 2 and "written by `dflash extract`, not imported" in text, text
