"""A rank of `dflash extract` under torchrun that fails mid-run stops the others at their next
shard, every rank raising its error, named; the shards committed stay, and a rerun resumes.

Review finding: as generate's chunks did (test_review_generate_rank_failure), the failed rank
waited in the gather at the end of the extracting section (failure_shared) while every other
rank filled and wrote all its remaining shards first: on a real run a whole share, hours.
Measured under `torchrun --nproc_per_node 2` on the CPU, 30 shards, 1 s each, rank 1's writer
failing to commit shard 3: rank 0 wrote all 14 of its remaining shards, 16.2 s from the failure
to the exit; now 2 (4 and 6), 3.6 s. One of them is rank 1's own delay: it learns of its
writer's failure as it asks for its next buffer, after filling one more shard.

Review finding: a rank interrupted (Ctrl-C: KeyboardInterrupt) left the section without saying
so: measured under two `torchrun --nnodes 2` on one CPU host (one rank each, 77 shards of 1 s),
Ctrl-C on the second node stopped its rank, and rank 0, whose torchrun does not end it, filled
its 35 remaining shards (40 s; on a real run its whole share, hours) before failing in the
meeting with gloo's "Connection closed by peer"; now it stops after the shard in flight (1.2 s)
with `stopped: rank 1 was interrupted (Ctrl-C, SIGINT)`, exit 130.

Two gloo ranks as in test_review_rank0_sections, writer threads, two scenarios in one pair of
processes: rank 1's writer fails committing its second shard (3), or rank 1 is interrupted
filling it; rank 0 (5 shards) fills its second shard (2) only once rank 1's failure shows on
the group's store, then must stop before its third (4).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from test_extract import file_digests, make_config, write_data
from test_review_rank0_sections import (
    _as_torchrun_rank,
    _in_group,
    _no_space,
    _run_ranks,
    _with_out,
    interruptible,
)

from common.inspect_verify import verify_store
from common.store import committed_shards, shards_dir
from stage1_extract.config import ExtractConfig
from stage1_extract.run import run_extract

NUM_ROWS = 5  # 8 rows (write_data adds 3 short ones), 10 sequences of 64 tokens
NUM_SHARDS = 10  # one sequence a shard: even ones are rank 0's, odd ones rank 1's


SCENARIOS = ("disk-full", "interrupted")


def _rank(rank: int, root: Path, cfg: ExtractConfig, seen: Any) -> None:
    import common.distributed as distributed
    import stage1_extract.run as extract_run
    import stage1_extract.writer as writer

    real_commit, real_fill = writer.commit_folder, extract_run.fill_shard
    scenario = ""

    def commit_folder(tmp: Path, final: Path, *args: Any) -> None:
        if scenario == "disk-full" and final.name == "shard-000003":
            raise _no_space(final)
        real_commit(tmp, final, *args)

    def fill_shard(job: Any, target: Any, index: int, *args: Any) -> Any:
        if scenario == "interrupted" and index == 3:  # Ctrl-C lands as rank 1 fills it
            raise KeyboardInterrupt
        if index == 2:  # rank 0 goes on from its first shard once rank 1's failure shows
            deadline = time.monotonic() + 60
            while not distributed.another_rank_failed() and time.monotonic() < deadline:
                time.sleep(0.01)
        return real_fill(job, target, index, *args)

    extract = interruptible(extract_run.run_extract)
    outcomes = {}
    with pytest.MonkeyPatch.context() as patch:
        _as_torchrun_rank(patch, rank, extract_run)
        patch.setattr(writer, "commit_folder", commit_folder)
        patch.setattr(extract_run, "fill_shard", fill_shard)
        for scenario in SCENARIOS:
            out = _with_out(cfg, "store", root / scenario)
            outcomes[scenario] = _in_group(root, scenario, rank, extract, out)
    seen.put((rank, outcomes))


@pytest.fixture(scope="module")
def outcomes(
    tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ExtractConfig, Path, dict[int, dict[str, tuple[str, float]]]]:
    """Both scenarios run by one pair of ranks: the config, the folder of their stores (one
    per scenario, named so) and each rank's outcome of each."""
    root = tmp_path_factory.mktemp("rank-failure")
    sets = ["run.progress=false", "store.sequences_per_shard=1", "run.writer_threads=1"]
    cfg = make_config(tiny_qwen3, write_data(root, NUM_ROWS), root / "unset", *sets)
    return cfg, root, _run_ranks(_rank, root, cfg)


def _shard_digests(store: Path) -> dict[str, str]:
    return {k: v for k, v in file_digests(store).items() if k.startswith("shards/shard-")}


def test_a_failed_rank_stops_the_others_at_their_next_shard(outcomes) -> None:
    cfg, root, seen = outcomes
    (own, _), (told, seconds) = seen[1]["disk-full"], seen[0]["disk-full"]
    assert "disk full while writing shard 3" in own and "RankFailed" not in own, own
    assert told.startswith("RankFailed: rank 1 failed"), told
    assert "disk full while writing shard 3" in told, told
    _check_stopped_then_resumed(_with_out(cfg, "store", root / "disk-full"), seconds)


def test_an_interrupted_rank_stops_the_others_at_their_next_shard(outcomes) -> None:
    cfg, root, seen = outcomes
    (own, _), (told, seconds) = seen[1]["interrupted"], seen[0]["interrupted"]
    assert own == "Interrupted: KeyboardInterrupt", own
    # rank 0 does not wait in the meeting for rank 1 (gone): the process-group timeout (8 s)
    # would end it with a gloo error
    assert told.startswith("Stopped: rank 1 was interrupted (Ctrl-C, SIGINT)"), told
    _check_stopped_then_resumed(_with_out(cfg, "store", root / "interrupted"), seconds)


def _check_stopped_then_resumed(cfg: ExtractConfig, seconds: float) -> None:
    """Rank 1 stopped at its second shard (3), rank 0 after its second (2); a rerun resumes."""
    out = Path(cfg.store.out)
    done = committed_shards(out)
    assert 1 in done and 3 not in done
    # shard 0 before rank 1 failed, shard 2 (in flight then); not all five
    assert [i for i in done if i % 2 == 0] == [0, 2], (done, f"{seconds:.1f} s")
    assert not list(shards_dir(out).glob(".tmp-*"))

    kept = _shard_digests(out)
    run_extract(cfg)  # the rerun, one process
    assert committed_shards(out) == list(range(NUM_SHARDS))
    assert kept.items() <= _shard_digests(out).items()  # the committed shards as they were
    report = verify_store(out)
    assert report["ok"] and report["complete"], report["problems"]
    pieces = []  # every piece of every document stored exactly once
    for index in range(NUM_SHARDS):
        group = zarr.open_group(shards_dir(out) / f"shard-{index:06d}", mode="r")
        pieces += zip(group["doc_source_index"][...], group["doc_piece"][...], strict=True)
    assert len(set(pieces)) == len(pieces) == report["checked"]["documents"]
    assert np.unique([s for s, _ in pieces]).tolist() == list(range(NUM_ROWS + 3))
