"""export-best's best.json records how its figure is defined (the measure, how the drafter runs
for it, the block size and the stop ids a reply's stop is counted by): a later version that
measures otherwise (as the recorded generation stop ids changed what chained_tau counts on the
same dev store) compared its figures with the old definition's and could keep a worse drafter,
or replace a better one. A record of another definition starts the best afresh, said in the
log; a best.json from before the record is read as before.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from log_capture import dflash_messages
from store_factory import FactorySpec, build_store

from common.store import open_store
from evaluation.chained import unstored_stop_ids
from stage2_train.best import (
    BEST_DIR,
    BEST_FILE,
    DEV_MEASURE,
    best_record,
    best_so_far,
    dev_definition,
)

DEV = ("/data/dev", "key-a")


def _write(out: Path, text: str) -> None:
    (out / BEST_DIR).mkdir(exist_ok=True)
    (out / BEST_DIR / BEST_FILE).write_text(text)


def test_the_definition_is_recorded_and_compared(tmp_path: Path) -> None:
    definition = dev_definition(16, [151645, 151643])
    assert definition == DEV_MEASURE | {"block_size": 16, "stop_ids": [151643, 151645]}
    _write(tmp_path, best_record(40, 3.5, *DEV, definition))
    assert json.loads((tmp_path / BEST_DIR / BEST_FILE).read_text())["definition"] == definition
    assert best_so_far(tmp_path, *DEV, dev_definition(16, (151643, 151645))) == 3.5
    others = [
        dev_definition(16, [151645]),  # the same store counted under other stop ids
        dev_definition(8, [151643, 151645]),
        DEV_MEASURE
        | {"version": DEV_MEASURE["version"] + 1, "block_size": 16}
        | {"stop_ids": [151643, 151645]},
    ]
    for other in others:
        with dflash_messages(logging.INFO) as logged:
            assert best_so_far(tmp_path, *DEV, other) == -math.inf
        said = [line for line in logged if "defined otherwise" in line]
        assert len(said) == 1 and json.dumps(other) in said[0], logged


def test_a_record_from_before_the_definition_is_read_as_before(tmp_path: Path) -> None:
    record = {"step": 40, "dev_chained_tau": 3.5, "dev_store": DEV[0]}
    _write(tmp_path, json.dumps(record | {"dev_store_content_key": DEV[1]}))
    assert best_so_far(tmp_path, *DEV, dev_definition(16, [2])) == 3.5
    _write(tmp_path, json.dumps(record))  # nor the dev store's key: taken as the current one's
    assert best_so_far(tmp_path, *DEV, dev_definition(16, [2])) == 3.5


def test_the_stop_ids_are_the_dev_stores_as_chained_tau_counts_them(tmp_path: Path) -> None:
    """train records unstored_stop_ids of the dev store: generate's recorded ids where the store
    copies them, else the tokenizer's and target config's end of sequence."""
    info = open_store(build_store(tmp_path / "dev", FactorySpec(num_sequences=2)))
    assert dev_definition(8, unstored_stop_ids(info.attrs))["stop_ids"] == [2]
