"""The export's `dflash_config.mask_token` for a mask id a server must resolve from the string.
An older SGLang DFlash worker ignores `mask_token_id` and takes the id from `mask_token`: the
tokenizer's mask token, a token of its vocabulary, or else a new token it adds at row
len(tokenizer); null stands for `<|MASK|>`. The export wrote null for the first row past the
tokenizer's vocabulary (a drafter's usual mask row where the tokenizer has no mask token) and
whenever the tokenizer was not in local files. Now that row gets `<|MASK|>` where the tokenizer
lacks it (such a server adds it at exactly that row), from the tokenizer or, without its files,
from the store's record of it; where no string is known to give the id, the log says that such
servers will use another token, and names the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from log_capture import dflash_messages
from test_export_mask_token import exported_mask_token, tokenizer_folder, write_run
from transformers import AutoTokenizer

from stage2_train.mask_token import SERVER_DEFAULT_MASK, mask_token_string

__all__ = ["tokenizer_folder"]  # the fixture, shared


def server_mask_id(folder: Path, mask_token: str | None) -> int:
    """The id an SGLang worker that resolves the mask from its string serves (its order: the
    tokenizer's mask token, a token of the vocabulary, else the string added as a new token)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    token = mask_token or SERVER_DEFAULT_MASK
    if tokenizer.mask_token == token:
        return tokenizer.mask_token_id
    if token in tokenizer.get_vocab():
        return tokenizer.get_vocab()[token]
    tokenizer.add_special_tokens({"mask_token": token})
    return tokenizer.mask_token_id


def _size(folder: Path) -> int:
    return len(AutoTokenizer.from_pretrained(folder))


def _record(folder: Path, **changes: object) -> dict:
    """The store's tokenizer record (FORMAT.md) of a tokenizer without mask-named tokens."""
    record = {"name_or_path": str(folder), "vocab_size": _size(folder)}
    return record | {"mask_token_id": None, "reserved_token_id": None} | changes


def test_the_first_row_past_the_vocabulary_gets_the_string_that_server_adds_there(
    tokenizer_folder: Path,
) -> None:
    row = _size(tokenizer_folder)
    token = mask_token_string({"name_or_path": str(tokenizer_folder)}, row)
    assert token == SERVER_DEFAULT_MASK  # before: None
    assert server_mask_id(tokenizer_folder, token) == row


def test_without_the_tokenizer_the_stores_record_tells(tokenizer_folder: Path) -> None:
    row = _size(tokenizer_folder)
    gone = _record(tokenizer_folder, name_or_path="no-such-org/tokenizer")
    with dflash_messages() as seen:
        assert mask_token_string(gone, row) == SERVER_DEFAULT_MASK  # before: None
    assert seen == []
    # a record that cannot rule out a mask-named token (older stores lack reserved_token_id,
    # or one is named) does not tell: null, and the warning
    for record in (
        {k: v for k, v in gone.items() if k != "reserved_token_id"},
        gone | {"reserved_token_id": 7},
    ):
        assert mask_token_string(record, row) is None


def test_export_reads_the_record_of_the_checkpoints_store(tmp_path: Path) -> None:
    """A checkpoint names its tokenizer alone; its store (while there) holds the record."""
    store = tmp_path / "store"
    store.mkdir()
    record = {"name_or_path": "no-such-org/tokenizer", "vocab_size": 60}
    record |= {"mask_token_id": None, "reserved_token_id": None}
    attrs = {"dflash": {"tokenizer": record, "content_key": "k"}}
    (store / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs})
    )
    meta = {"tokenizer": {"name_or_path": record["name_or_path"]}, "mask_token": None}
    run = write_run(tmp_path / "run", 60, **meta, store=str(store), store_content_key="k")
    assert exported_mask_token(run) == SERVER_DEFAULT_MASK  # before: None
    other = write_run(tmp_path / "other", 60, **meta, store=str(store), store_content_key="x")
    assert exported_mask_token(other) is None  # another store at that path now: not its record


@pytest.mark.parametrize("case", ["row_beyond", "not_local", "no_tokenizer"])
def test_where_no_string_gives_the_id_the_log_says_so(tokenizer_folder: Path, case: str) -> None:
    row = _size(tokenizer_folder)
    attrs, token_id, fix = {"name_or_path": str(tokenizer_folder)}, row + 1, "mask_token_id"
    if case == "not_local":
        attrs, token_id, fix = {"name_or_path": "no-such-org/tokenizer"}, 3, "hf download"
    elif case == "no_tokenizer":
        attrs, token_id, fix = {"name_or_path": None}, 3, "by hand"
    with dflash_messages() as seen:
        assert mask_token_string(attrs, token_id) is None
    assert len(seen) == 1, seen
    assert f"mask_token_id {token_id} is written" in seen[0]
    assert "will use another token than the drafter was trained with" in seen[0]
    assert fix in seen[0].split("To have the string:")[1]
    if case == "row_beyond":
        assert "drafter.mask_token_id naming a token of the tokenizer" in seen[0]
        assert f"or {row}, the row such a server adds {SERVER_DEFAULT_MASK} at" in seen[0]
