"""`dflash evaluate-offline` on a store with a cut shard file: refused before any work, naming
the shard, the file and the fix, as `dflash train` and `dflash convert` refuse it. It used to
blank the damaged sequences in the random-anchor pass (figures without them, no word) and then
fail the chained pass as a bug (exit 1, `error: Damaged: ...`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tiny_runs import tiny_store_and_run

from common.store import StoreError
from evaluation.offline import OfflineEvalConfig, run_offline_eval


@pytest.fixture(scope="module")
def run(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    # the default hidden_dtype: nvfp4
    store, run = tiny_store_and_run(tiny_qwen3, tmp_path_factory.mktemp("offline-damaged"), 1)
    return store, run / "export"


def test_a_cut_shard_file_is_refused_before_evaluating(
    run: tuple[Path, Path], tmp_path: Path
) -> None:
    store, export = run
    cut = tmp_path / "store"
    shutil.copytree(store, cut)
    last = sorted((cut / "shards").iterdir())[-1]
    chunk = next(p for p in sorted((last / "hidden").rglob("*")) if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:10])
    with pytest.raises(StoreError) as refused:
        run_offline_eval(OfflineEvalConfig(str(export), str(cut)))
    message = str(refused.value)
    assert f"{last.name} array hidden: file hidden/" in message, message
    assert "is 10 bytes" in message and "rerun the same `dflash extract`" in message, message
    # the shards before it still evaluate: only the shards read are checked
    figures = run_offline_eval(OfflineEvalConfig(str(export), str(cut), max_sequences=4))
    assert figures["sequences"] == 4
