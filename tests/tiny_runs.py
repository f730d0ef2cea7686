"""A tiny extraction and training as several tests set them up: the example's first rows, the
debug config, 64-token sequences in shards of four (the default nvfp4 store)."""

from __future__ import annotations

from pathlib import Path

from common.config import build_config
from common.tiny import EXAMPLE_DATA
from stage1_extract.config import ExtractConfig
from stage1_extract.run import run_extract
from stage2_train.config import TrainConfig
from stage2_train.train import run_train

DEBUG = Path(__file__).parents[1] / "configs" / "debug.yaml"


def tiny_extract_config(target: Path, work: Path, rows: int = 8) -> ExtractConfig:
    """The config of extracting `rows` example rows with `target` into `work`/store."""
    data = work / "data.jsonl"
    data.write_text("\n".join(EXAMPLE_DATA.read_text().splitlines()[:rows]) + "\n")
    sets = [f"target.model={target}", f"data.path={data}", f"store.out={work / 'store'}"]
    sets += ["packing.seq_len=64", "store.sequences_per_shard=4", "run.progress=false"]
    return build_config(ExtractConfig, DEBUG, "extract", sets)


def tiny_store_and_run(target: Path, work: Path, steps: int) -> tuple[Path, Path]:
    """`work`/store extracted and `work`/run trained on it for `steps` steps, no evaluation."""
    run_extract(tiny_extract_config(target, work))
    sets = [f"data.store={work / 'store'}", f"run.out={work / 'run'}", "run.progress=false"]
    sets += [f"optim.max_steps={steps}", "run.eval_every=0", "data.holdout_sequences=0"]
    run_train(build_config(TrainConfig, DEBUG, "train", sets))
    return work / "store", work / "run"
