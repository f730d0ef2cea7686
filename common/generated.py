"""The provenance of a dataset that `dflash generate` wrote: its manifest, read by generate
(to resume), by extract (which copies it into the store's attributes) and by inspect.

    FOLDER/.dflash-generate/manifest.json: format, version, the settings that decide the rows
    (`content`, hashed into `key`), the target's fingerprint, and once complete the `counts`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

META_DIR = ".dflash-generate"
MANIFEST = "manifest.json"
FORMAT = "dflash-generate"
VERSION = 1
# the manifest content key, present (the ids) where completion rows were written after their
# prompt without the suffix the tokenizer appends (an EOS), as extract stores them
PROMPT_SUFFIX_LEFT_OUT = "prompt_suffix_left_out"


def manifest_path(folder: Path) -> Path:
    return folder / META_DIR / MANIFEST


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The manifest of a generate output folder, or None when `folder` is not one (a file,
    a hub name, or a folder of other data)."""
    path = manifest_path(Path(folder).expanduser())
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err}); rerun the same `dflash generate` to rewrite it"
        ) from err
    if manifest.get("format") != FORMAT or manifest.get("version", 0) > VERSION:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')} is "
            f"not one this dflash-offline reads ({FORMAT} <= {VERSION}); upgrade dflash-offline"
        )
    return manifest


def eos_ids(*values: Any) -> list[int]:
    """The ids of end-of-sequence settings as tokenizers and configs give them (an id, a list
    of ids, or None), in order."""
    ids: list[int] = []
    for value in values:
        ids += value if isinstance(value, list) else [] if value is None else [value]
    return ids


def provenance(manifest: dict[str, Any]) -> dict[str, Any]:
    """What a store records of the generated data it was extracted from."""
    keys = (
        "key",
        "content",
        "target",
        "source",
        "backend",
        "stop_ids",
        "counts",
        "complete",
        "created",
    )
    return {k: manifest[k] for k in keys if k in manifest}
