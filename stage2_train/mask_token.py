"""The mask token's string for an export's `dflash_config.mask_token`.

vLLM and current SGLang read the mask by its id (`mask_token_id`, always written); a server
that resolves it from this string instead (SGLang before it read the id) must map the string
back to the id the drafter trained with. `mask_token_string` finds that string from the
tokenizer the store names (local files only) or the store's record of it;
`checkpoint_mask_token` does so for a checkpoint's export. Where no string is known to give the
id, the config keeps null and one warning names the fix.
"""

from __future__ import annotations

from common.logging import get_logger
from common.store import StoreError, read_root_attrs

# What a server that resolves the mask from dflash_config.mask_token rather than its id (SGLang
# before it read mask_token_id) takes a null for; a string the tokenizer lacks it adds as a new
# token, at row len(tokenizer): the first row past the tokenizer's vocabulary
SERVER_DEFAULT_MASK = "<|MASK|>"


def mask_token_string(tokenizer_attrs: dict, token_id: int) -> str | None:
    """The mask token's string, which a server resolving the mask from it maps back to
    `token_id`: the token's own, from the tokenizer the store names, read from local files only
    (its folder, or the Hugging Face cache); for the first row past the tokenizer's vocabulary,
    SERVER_DEFAULT_MASK where the tokenizer lacks it (such a server adds it at that row), also
    told by the store's record (`tokenizer_attrs`, FORMAT.md) when the files are not there.
    None, with a warning naming the fix, where no string is known to give that id."""
    name = tokenizer_attrs.get("name_or_path")
    if not name:
        _warn_null_mask(token_id, "the store names no tokenizer", BY_HAND)
        return None
    from transformers import AutoTokenizer

    # Local files only: for a hub id without HF_HUB_OFFLINE, transformers asks the hub first even
    # when the files are cached, and a machine without network sits through its retries (~47 s)
    # at every training start, for a string that only labels the export. The machine that
    # extracted the store loaded this tokenizer, so it has the folder or the cached files.
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:  # not there, or not a tokenizer
        if _new_row_by_record(tokenizer_attrs, token_id):
            return SERVER_DEFAULT_MASK
        why = (
            f"tokenizer {name} could not be read from local files, its folder or the Hugging "
            f"Face cache: {err}"
        )
        fix = (
            f"download the tokenizer (`hf download {name}`, or HF_HUB_CACHE naming a cache "
            f"that holds it) and rerun `dflash export RUN`, or {BY_HAND}"
        )
        _warn_null_mask(token_id, why, fix)
        return None
    size = len(tokenizer)
    if token_id < size:
        return tokenizer.convert_ids_to_tokens(token_id)
    taken = tokenizer.get_vocab().get(SERVER_DEFAULT_MASK)
    if token_id == size and taken is None:
        return SERVER_DEFAULT_MASK
    why = f"mask id {token_id} is an embedding row past tokenizer {name}'s {size} tokens" + (
        f", and its {SERVER_DEFAULT_MASK} is id {taken}" if taken is not None else ""
    )
    fix = (
        "serve it with a server that reads mask_token_id, or train with drafter.mask_token_id "
        "naming a token of the tokenizer (its mask token, a reserved special token)"
        + (
            f" or {size}, the row such a server adds {SERVER_DEFAULT_MASK} at"
            if taken is None
            else ""
        )
    )
    _warn_null_mask(token_id, why, fix)
    return None


BY_HAND = "set dflash_config.mask_token in the export's config.json by hand"


def _new_row_by_record(tokenizer_attrs: dict, token_id: int) -> bool:
    """Whether the store's tokenizer record shows `token_id` as the first row past the
    vocabulary of a tokenizer without SERVER_DEFAULT_MASK: no mask token and no added token
    named like a mask (`reserved_token_id` null names neither a mask-named nor a reserved one;
    stores before that record cannot tell)."""
    return (
        tokenizer_attrs.get("vocab_size") == token_id
        and tokenizer_attrs.get("mask_token_id") is None
        and "reserved_token_id" in tokenizer_attrs
        and tokenizer_attrs["reserved_token_id"] is None
    )


def _warn_null_mask(token_id: int, why: str, fix: str) -> None:
    get_logger().warning(
        "export: no mask token string (%s): the export's dflash_config.mask_token stays null. "
        "Its mask_token_id %d is written, which vLLM and current SGLang use; a server that "
        "resolves the mask from that string instead (SGLang before it read mask_token_id) "
        "takes null for %s and will use another token than the drafter was trained with. "
        "To have the string: %s",
        why,
        token_id,
        SERVER_DEFAULT_MASK,
        fix,
    )


def checkpoint_mask_token(meta: dict, token_id: int) -> str | None:
    """The mask token's string for the export of a checkpoint: the one training recorded, else
    (null: the tokenizer was not in local files then) read again from local files, which
    `hf download` may have filled since. The tokenizer is the one the checkpoint names, or for
    checkpoints older than that record, the one its store names while the store is there; the
    store's record of it (its size and special ids) is used while the store is there."""
    if meta.get("mask_token") is not None:
        return meta["mask_token"]
    tokenizer = meta.get("tokenizer")
    try:
        attrs = read_root_attrs(meta["store"])
        stored = attrs["tokenizer"]
    except (StoreError, KeyError, TypeError) as err:
        if tokenizer is None:
            why = f"the checkpoint does not name its tokenizer and its store cannot tell ({err})"
            _warn_null_mask(token_id, why, BY_HAND)
            return None
        return mask_token_string(tokenizer, token_id)
    same_store = meta.get("store_content_key") in (None, attrs.get("content_key"))
    if tokenizer is None or (
        same_store and stored.get("name_or_path") == tokenizer.get("name_or_path")
    ):
        tokenizer = stored
    return mask_token_string(tokenizer, token_id)
