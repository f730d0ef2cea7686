"""`dflash evaluate-offline` on a store with a cut shard file: refused before any work, naming
the shard, the file and the fix, as `dflash train` and `dflash convert` refuse it. It used to
blank the damaged sequences in the random-anchor pass (figures without them, no word) and then
fail the chained pass as a bug (exit 1, `error: Damaged: ...`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from common.config import build_config
from common.store import StoreError
from common.tiny import EXAMPLE_DATA
from evaluation.offline import OfflineEvalConfig, run_offline_eval
from stage1_extract.config import ExtractConfig
from stage1_extract.run import run_extract
from stage2_train.config import TrainConfig
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


@pytest.fixture(scope="module")
def run(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("offline-damaged")
    data = work / "data.jsonl"
    data.write_text("\n".join(EXAMPLE_DATA.read_text().splitlines()[:8]) + "\n")
    store = work / "store"  # the default hidden_dtype: nvfp4
    sets = [f"target.model={tiny_qwen3}", f"data.path={data}", f"store.out={store}"]
    sets += ["packing.seq_len=64", "store.sequences_per_shard=4", "run.progress=false"]
    run_extract(build_config(ExtractConfig, DEBUG, "extract", sets))
    sets = [f"data.store={store}", f"run.out={work / 'run'}", "run.progress=false"]
    sets += ["optim.max_steps=1", "run.eval_every=0", "data.holdout_sequences=0"]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    return store, work / "run" / "export"


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
