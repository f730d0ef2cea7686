"""`dflash convert`: a store to one HDF5 file, and an HDF5 file of documents to a store.

    dflash convert STORE OUT.h5 [--shards 0-3,7] [--arrays tokens,hidden] [--compression lzf]
    dflash convert IN.h5 STORE --target TARGET_FOLDER [--seq-len 3072]

The direction follows the source: a store folder is exported (to_hdf5.py), an HDF5 file is
imported (from_hdf5.py, reading the layout of hdf5_input.py). FORMAT.md, "HDF5 files",
documents both layouts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# options of each direction (the CLI passes None for those not given)
EXPORT_OPTIONS = ("shards", "arrays", "compression", "hidden_as")
IMPORT_OPTIONS = ("target", "seq_len", "sequences_per_shard", "packing", "overlong", "topk")
IMPORT_OPTIONS += ("hidden_dtype",)  # --overwrite applies to both directions


def run_convert(source: str, dest: str, **options: Any) -> Path:
    """Convert a store to HDF5 or an HDF5 file to a store, by what `source` is; ValueError for
    a source that is neither or an option of the other direction."""
    given = {k: v for k, v in options.items() if v is not None and v is not False}
    path = Path(source)
    if path.is_dir():
        if wrong := sorted(set(given) & set(IMPORT_OPTIONS)):
            raise ValueError(
                f"{source} is a store, exported to HDF5: {_flags(wrong)} apply only to an "
                "import (dflash convert IN.h5 STORE)"
            )
        from dflash_offline.convert.to_hdf5 import store_to_hdf5

        return store_to_hdf5(source, dest, **given)
    if path.is_file():
        if wrong := sorted(set(given) & set(EXPORT_OPTIONS)):
            raise ValueError(
                f"{source} is a file, imported into a store: {_flags(wrong)} apply only to an "
                "export (dflash convert STORE OUT.h5)"
            )
        from dflash_offline.convert.from_hdf5 import ImportOptions, hdf5_to_store

        return hdf5_to_store(source, dest, ImportOptions(**given))
    raise ValueError(
        f"{source} does not exist: pass a store folder (to export it to HDF5) or an HDF5 file "
        "(to import it into a store)"
    )


def _flags(names: list[str]) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)
