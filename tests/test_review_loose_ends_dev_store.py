"""`data.dev_store` of another tokenizer of the same size: the dev store was checked against
the training store by vocabulary size alone, so a store extracted with a base model's tokenizer
beside its instruct twin's (one vocabulary, other end of sequence and chat template) passed, and
dev chained tau counted other stop tokens. Where both stores name their tokenizer, its special
ids and chat template are compared too, the error naming both stores and the fix; a store that
names none (converted from HDF5 without a tokenizer) keeps the size check alone.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from store_factory import FactorySpec, build_store

from common.store import ROOT_ATTR, open_store
from stage2_train.inputs import open_dev_store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_store(tmp_path_factory.mktemp("s") / "store", FactorySpec(num_sequences=4))


def _tokenizer(src: Path, dst: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of store `src` at `dst`, its root `tokenizer` record changed by `edit`."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "zarr.json").read_text())
    edit(doc["attributes"][ROOT_ATTR]["tokenizer"])
    (dst / "zarr.json").write_text(json.dumps(doc))
    return dst


def test_another_end_of_sequence_and_template_is_refused_naming_both_stores(
    tmp_path: Path, store: Path
) -> None:
    def instruct(tok: dict) -> None:
        tok.update(name_or_path="org/chat", eos_token_id=7, chat_template="{{ messages }}")

    dev = _tokenizer(store, tmp_path / "dev", instruct)
    train = open_store(store)
    with pytest.raises(ValueError) as err:
        open_dev_store(str(dev), train, train.tapped_layers)
    assert str(err.value) == (
        f"data.dev_store {dev} does not match the training store {store} (tokenizer org/chat "
        "vs factory (eos_token_id 7 vs 2, chat templates differ)): extract it with the same "
        "target, tokenizer and target.tapped_layers as the training store (target factory, "
        "tokenizer factory), or leave data.dev_store unset"
    )


@pytest.mark.parametrize("key", ["pad_token_id", "mask_token_id", "reserved_token_id"])
def test_each_special_id_is_compared(tmp_path: Path, store: Path, key: str) -> None:
    train = open_store(_tokenizer(store, tmp_path / "train", lambda t: t.update({key: 5})))
    dev = _tokenizer(store, tmp_path / "dev", lambda t: t.update({key: 6}))
    with pytest.raises(ValueError, match=rf"\(tokenizer factory vs factory \({key} 6 vs 5\)\)"):
        open_dev_store(str(dev), train, train.tapped_layers)


def test_stores_that_record_less_keep_the_size_check(tmp_path: Path, store: Path) -> None:
    """A store converted without a tokenizer names none (its ids are the file's, its template
    null); an older store has no reserved_token_id; neither is refused for what it lacks."""
    train = open_store(store)
    unnamed = _tokenizer(
        store, tmp_path / "unnamed", lambda t: t.update(name_or_path=None, eos_token_id=None)
    )
    assert open_dev_store(str(unnamed), train, train.tapped_layers).path == unnamed
    older = open_store(
        _tokenizer(store, tmp_path / "older", lambda t: t.pop("reserved_token_id", 0))
    )
    dev = _tokenizer(store, tmp_path / "dev", lambda t: t.update(reserved_token_id=9))
    assert open_dev_store(str(dev), older, older.tapped_layers).path == dev
    # a tokenizer of the same record under another name (a local copy of a hub id's files)
    copy = _tokenizer(store, tmp_path / "copy", lambda t: t.update(name_or_path="/models/tok"))
    assert open_dev_store(str(copy), train, train.tapped_layers).path == copy
    smaller = _tokenizer(
        store, tmp_path / "smaller", lambda t: t.update(name_or_path=None, vocab_size=40)
    )
    with pytest.raises(ValueError, match=r"\(tokenizer of 40 vs 48 tokens\)"):
        open_dev_store(str(smaller), train, train.tapped_layers)


@pytest.mark.parametrize("dtype", ["nvfp4", "float8_e4m3fn", "bfloat16"])
def test_a_dev_store_of_rounded_features_is_announced(
    tmp_path: Path, dtype: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The default store is nvfp4 (forty-first session): a dev store extracted as the training
    store was would score the drafter on rounded features, where a server feeds it the target's
    own; bf16 dev stores gave the online figure. Said at the start, with the fix."""
    spec = FactorySpec(num_sequences=4, hidden_dtype=dtype)
    train, dev = build_store(tmp_path / "t", spec), build_store(tmp_path / "d", spec)
    info = open_store(train)
    open_dev_store(str(dev), info, info.tapped_layers)
    said = " ".join(caplog.text.split())
    if dtype == "bfloat16":
        assert "features, which a server never feeds" not in said
    else:
        assert f"data.dev_store {dev} holds {dtype} features, which a server never feeds" in said
        assert "extract the dev store with --set store.hidden_dtype=bfloat16" in said


def test_a_rounded_dev_store_is_announced_once_per_run(tmp_path: Path) -> None:
    """`dflash train --set data.dev_store=...` on the default (nvfp4) dev store said its note
    twice: once in the launcher's input checks, again when the worker opened the store."""
    from common.config import build_config
    from common.logging import get_logger
    from stage2_train.config import TrainConfig
    from stage2_train.train import run_train

    spec = FactorySpec(num_sequences=6, hidden_dtype="nvfp4")
    train, dev = build_store(tmp_path / "t", spec), build_store(tmp_path / "d", spec)
    config = Path(__file__).parents[1] / "configs" / "debug.yaml"
    sets = [f"data.store={train}", f"run.out={tmp_path / 'r'}", "run.progress=false"]
    sets += ["optim.max_steps=1", f"data.dev_store={dev}", "data.holdout_sequences=2"]
    # a handler of our own on the logger: caplog's sees a record twice where the logger also
    # propagates to the root
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    log = get_logger()
    log.addHandler(handler)
    try:
        run_train(build_config(TrainConfig, config, "train", sets))
    finally:
        log.removeHandler(handler)
    notes = [m for m in said if m.startswith(f"data.dev_store {dev} holds nvfp4 features")]
    assert len(notes) == 1, said
